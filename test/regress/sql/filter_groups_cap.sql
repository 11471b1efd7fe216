-- Filter groups at their limits (src/claims/groups.c): a group takes at
-- most 16 members, and a partition whose keys would overflow the newest
-- group's capacity starts a new group sized for it; every key stays found.
-- The clock is moved with idempotency.debug_clock_offset.
CREATE EXTENSION idempotency;

SELECT idem_configure(retention => '3 days', partition_interval => '1 hour', premake => 2);
-- 20 hourly partitions: 10 keys each, except 1 100 in hour 17
\o /dev/null
SELECT format('SET idempotency.debug_clock_offset = %L', h || 'h'),
       'SELECT * FROM idem_maintain()',
       format('SELECT idem_claim(''cap%s-'' || i, ''cap'') FROM generate_series(1, %s) i',
              h, CASE WHEN h = 17 THEN 1100 ELSE 10 END)
  FROM generate_series(0, 19) h \gexec
SET idempotency.debug_clock_offset = '22h';
SELECT * FROM idem_maintain();
SELECT * FROM idem_maintain();
\o
SELECT count(*) AS sealed_with_keys FROM idempotency.partition_registry WHERE sealed AND nkeys > 0;

-- hours 0-15 fill the first group (16 members), hour 16 starts the second;
-- hour 17 does not fit in it (1 024 keys) and starts a third, sized for 16
-- partitions of 1 100 keys, which hours 18 and 19 join
SELECT row_number() OVER (ORDER BY id) AS n, cardinality(members) AS members, nkeys, capacity
  FROM idempotency.filter_groups ORDER BY id;
-- each sealed partition with keys is in exactly one group
SELECT count(*) AS memberships, count(DISTINCT m) AS partitions
  FROM idempotency.filter_groups g, unnest(g.members) m;
SELECT count(*) AS not_in_a_group
  FROM idempotency.partition_registry r
 WHERE r.sealed AND r.nkeys > 0
   AND NOT EXISTS (SELECT FROM idempotency.filter_groups g WHERE r.relid = ANY (g.members));

-- every old key is a duplicate; new keys are new
SELECT count(*) FILTER (WHERE idem_claim('cap' || h || '-' || i, 'cap')) AS claimed_again,
       count(*) AS tried
  FROM generate_series(0, 19) h, generate_series(1, CASE WHEN h = 17 THEN 1100 ELSE 10 END) i;
SELECT count(*) FILTER (WHERE idem_claim('cap-new-' || i, 'cap')) AS new_keys
  FROM generate_series(1, 500) i;

-- a group deleted by hand: its members are tested alone, and every key of
-- theirs is still found
DELETE FROM idempotency.filter_groups WHERE id = (SELECT max(id) FROM idempotency.filter_groups);
SELECT count(*) FILTER (WHERE idem_claim('cap' || h || '-' || i, 'cap')) AS claimed_again_loose
  FROM generate_series(16, 19) h, generate_series(1, CASE WHEN h = 17 THEN 1100 ELSE 10 END) i;

-- A group's filter fits a quarter of idempotency.local_filter_memory as the
-- sealing session has it (64kB: 16 kB, 13 107 keys): a partition of 20 000
-- keys is left out of every group, one of 5 000 starts a group of that
-- capacity; the keys of both are still found.
SET idempotency.local_filter_memory = '64kB';
SET idempotency.debug_clock_offset = '23h';
SELECT count(*) >= 0 AS ran FROM idem_maintain();
SELECT count(*) FILTER (WHERE idem_claim('big-' || i, 'cap')) AS big FROM generate_series(1, 20000) i;
SET idempotency.debug_clock_offset = '24h';
SELECT count(*) >= 0 AS ran FROM idem_maintain();
SELECT count(*) FILTER (WHERE idem_claim('mid-' || i, 'cap')) AS mid FROM generate_series(1, 5000) i;
SET idempotency.debug_clock_offset = '27h';
SELECT count(*) >= 0 AS ran FROM idem_maintain();
SELECT count(*) >= 0 AS ran FROM idem_maintain();
RESET idempotency.local_filter_memory;
SELECT cardinality(members) AS members, nkeys, capacity
  FROM idempotency.filter_groups ORDER BY id DESC LIMIT 1;
SELECT count(*) AS sealed_alone
  FROM idempotency.partition_registry r
 WHERE r.sealed AND r.nkeys = 20000
   AND NOT EXISTS (SELECT FROM idempotency.filter_groups g WHERE r.relid = ANY (g.members));
SELECT count(*) FILTER (WHERE idem_claim('big-' || i, 'cap')) AS big_again,
       count(*) FILTER (WHERE idem_claim('mid-' || i, 'cap')) AS mid_again
  FROM generate_series(1, 5000) i;
SELECT count(*) FILTER (WHERE idem_claim('cap-new2-' || i, 'cap')) AS new_keys
  FROM generate_series(1, 500) i;

RESET idempotency.debug_clock_offset;
SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
