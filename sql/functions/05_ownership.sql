-- Which relations are ours (src/common/ownership.c): the SECURITY DEFINER
-- functions that read a partition by its registry entry ask this first, and
-- read nothing that is not a plain table of ours.

CREATE OR REPLACE FUNCTION idempotency.relation_distrust(rel regclass, parent regclass)
    RETURNS text
    AS 'MODULE_PATHNAME', 'idem_relation_distrust_sql' LANGUAGE C STABLE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency.relation_distrust(regclass, regclass) IS
    'NULL if rel is a partition of parent as the extension makes them; else why not';
REVOKE ALL ON FUNCTION idempotency.relation_distrust(regclass, regclass) FROM PUBLIC;
