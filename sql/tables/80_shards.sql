-- Scale-out with PL/Proxy: the shard ownership table (the guard, its
-- cache trigger and the generators of router-side DDL are in
-- sql/functions/80_shards.sql).  See src/shards/shards.c.

-- At most one row: this database owns hash partitions owned of partitions
-- (PL/Proxy's partition = hashtext(routing key) & (partitions - 1)).  No
-- row: not sharded, every routed call passes.  A configuration table, so a
-- database moved by pg_dump keeps its ownership with its claims.
CREATE TABLE idempotency.shard_ownership (
    singleton     boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    partitions    integer NOT NULL
                  CHECK (partitions BETWEEN 1 AND 65536 AND partitions & (partitions - 1) = 0),
    owned         integer[] NOT NULL
                  CHECK (array_position(owned, NULL) IS NULL
                         AND 0 <= ALL (owned) AND partitions > ALL (owned)),
    frozen        boolean NOT NULL DEFAULT false,  -- refuse routed calls (a move in progress)
    configured_at timestamptz NOT NULL DEFAULT now()
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.shard_ownership', '');
