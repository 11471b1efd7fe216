-- Filter groups (src/claims/groups.c): sealing a partition adds its keys
-- to a group's filter; a claim of a key of any member is still found (the
-- group's filter never rules out a key it holds), a new key is new and
-- never reads its members' own filters; a damaged group rules nothing out;
-- a group goes once none of its members is left.  The clock is moved with
-- idempotency.debug_clock_offset, so nothing waits for time to pass.
CREATE EXTENSION idempotency;

SELECT idem_configure(retention => '3 days', partition_interval => '1 hour', premake => 2);
SELECT count(*) > 0 AS made FROM idem_maintain();
-- keys in three partitions, an hour apart
SELECT count(*) FILTER (WHERE idem_claim('g1-' || i, 'groups')) FROM generate_series(1, 200) i;
SET idempotency.debug_clock_offset = '1h';
SELECT count(*) > 0 AS made FROM idem_maintain();
SELECT count(*) FILTER (WHERE idem_claim('g2-' || i, 'groups')) FROM generate_series(1, 200) i;
SET idempotency.debug_clock_offset = '2h';
SELECT count(*) > 0 AS made FROM idem_maintain();
SELECT count(*) FILTER (WHERE idem_claim('g3-' || i, 'groups')) FROM generate_series(1, 200) i;
-- three hours on, the three are sealed
SET idempotency.debug_clock_offset = '5h';
SELECT count(*) > 0 AS sealed FROM idem_maintain() WHERE action = 'seal';
SELECT count(*) >= 0 AS ran FROM idem_maintain();

-- one group, listing every sealed partition that holds claims, and only those
SELECT count(*) AS groups, sum(nkeys) AS keys_added,
       bool_and(capacity >= nkeys) AS within_capacity
  FROM idempotency.filter_groups;
SELECT count(*) >= 3 AS sealed_with_keys,
       count(*) FILTER (WHERE r.relid = ANY (g.members)) = count(*) AS every_one_a_member
  FROM idempotency.partition_registry r, idempotency.filter_groups g
 WHERE r.sealed AND r.nkeys > 0;
SELECT count(*) AS members_not_sealed_with_keys
  FROM idempotency.filter_groups g, unnest(g.members) m
 WHERE NOT EXISTS (SELECT FROM idempotency.partition_registry r
                    WHERE r.relid = m AND r.sealed AND r.nkeys > 0);

-- every old key is a duplicate, through the group's filter; new keys are new
SELECT count(*) FILTER (WHERE idem_claim('g' || b || '-' || i, 'groups')) AS claimed_again,
       count(*) AS tried
  FROM generate_series(1, 3) b, generate_series(1, 200) i;
SELECT count(*) FILTER (WHERE idem_claim('new-' || i, 'groups')) AS new_keys
  FROM generate_series(1, 200) i;

-- The members' own filters damaged: a new key that the group rules out
-- never reads them.  A backend loads a filter after 64 look-ups of it
-- (filters.c): were the members tested one by one, 100 new keys would load
-- the damaged filters, with a WARNING each.  An old key is still found,
-- through the partition's index.
UPDATE idempotency.partition_registry SET bloom = '\x00'::bytea WHERE sealed AND nkeys > 0;
SELECT count(*) FILTER (WHERE idem_claim('fresh-' || i, 'groups')) AS fresh_claimed
  FROM generate_series(1, 100) i;
SET client_min_messages = error;
SELECT count(*) FILTER (WHERE idem_claim('g' || b || '-' || i, 'groups')) AS old_claimed_again
  FROM generate_series(1, 3) b, generate_series(1, 100) i;
RESET client_min_messages;
-- repaired as the hint says: rebuilt, and still in their group
UPDATE idempotency.partition_registry SET bloom = NULL WHERE sealed AND nkeys > 0;
SELECT count(*) >= 3 AS rebuilt FROM idem_maintain() WHERE action = 'rebuild filter';
SELECT sum(nkeys) AS keys_in_groups FROM idempotency.filter_groups;

-- a damaged group rules nothing out: the duplicates are still found
\set VERBOSITY terse
UPDATE idempotency.filter_groups SET bloom = '\x00'::bytea;
SELECT count(*) FILTER (WHERE idem_claim('g' || b || '-' || i, 'groups')) AS claimed_again_damaged
  FROM generate_series(1, 3) b, generate_series(1, 200) i;
\set VERBOSITY default
DELETE FROM idempotency.filter_groups;

-- a partition sealed later starts a group of its own (the newest group
-- went); retention drops the members, and the groups go with them
SET idempotency.debug_clock_offset = '6h';
SELECT count(*) > 0 AS made FROM idem_maintain();
SELECT count(*) FILTER (WHERE idem_claim('g4-' || i, 'groups')) FROM generate_series(1, 50) i;
SET idempotency.debug_clock_offset = '9h';
SELECT count(*) >= 0 AS ran FROM idem_maintain();
SELECT count(*) >= 0 AS ran FROM idem_maintain();
SELECT count(*) AS groups, sum(nkeys) AS keys_added, min(capacity) AS capacity
  FROM idempotency.filter_groups;
SET idempotency.debug_clock_offset = '5d';
SELECT count(*) >= 0 AS ran FROM idem_maintain();
SELECT count(*) >= 0 AS ran FROM idem_maintain();
SELECT count(*) AS groups_left FROM idempotency.filter_groups;
SELECT idem_claim('g4-1', 'groups') AS claimed_after_retention;  -- a late duplicate, counted
RESET idempotency.debug_clock_offset;

SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
