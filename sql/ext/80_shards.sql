-- Scale-out with PL/Proxy: the shard ownership guard and the generator of
-- router-side DDL.  See src/shards.c and README "Scale-out".

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
GRANT SELECT ON idempotency.shard_ownership TO PUBLIC;
COMMENT ON TABLE idempotency.shard_ownership IS
    'which PL/Proxy hash partitions this database owns (set with idem_shard_configure())';

-- Every backend caches the row; any change tells them all to read it again.
-- ENABLE ALWAYS: a change made with session_replication_role = replica too.
CREATE FUNCTION idempotency.shard_changed() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_shard_changed' LANGUAGE C;
REVOKE ALL ON FUNCTION idempotency.shard_changed() FROM PUBLIC;
CREATE TRIGGER shard_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.shard_ownership
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.shard_changed();
ALTER TABLE idempotency.shard_ownership ENABLE ALWAYS TRIGGER shard_changed;

CREATE FUNCTION idem_shard_configure(partitions integer, owned integer[], frozen boolean DEFAULT false)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_shard_configure' LANGUAGE C VOLATILE;

CREATE FUNCTION idem_shard_partition(routing_key text, partitions integer)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_shard_partition' LANGUAGE C IMMUTABLE PARALLEL SAFE;

CREATE FUNCTION idem_shard_assert(routing_key text)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_shard_assert' LANGUAGE C VOLATILE PARALLEL RESTRICTED;

CREATE FUNCTION idem_claim_routed(routing_key text, key text, scope text DEFAULT 'default',
                                  payload jsonb DEFAULT NULL)
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_claim_routed' LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- A check that passes holds a lock on idempotency.shard_ownership to the
-- end of its transaction, and a reconfiguration waits for those (up to
-- lock_timeout): the check is granted to the handler roles that need it,
-- not to PUBLIC.  idem_claim_routed() is open like idem_claim(): its check
-- keeps the lock only once the claim succeeded, which takes INSERT on
-- idempotency.claims.  Configuring is for the table's owner.
REVOKE ALL ON FUNCTION idem_shard_assert(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_shard_configure(integer, integer[], boolean) FROM PUBLIC;

COMMENT ON FUNCTION idem_shard_configure(integer, integer[], boolean) IS
    'set the hash partitions this database owns, out of partitions (a power of 2); frozen refuses routed calls';
COMMENT ON FUNCTION idem_shard_partition(text, integer) IS
    'the partition PL/Proxy''s RUN ON hashtext(routing_key) picks: hashtext(routing_key) & (partitions - 1)';
COMMENT ON FUNCTION idem_shard_assert(text) IS
    'IK006 unless this database owns the routing key''s hash partition, IK007 while frozen or being reconfigured';
COMMENT ON FUNCTION idem_claim_routed(text, text, text, jsonb) IS
    'idem_shard_assert(routing_key), then idem_claim(key, scope, payload)';

-- The router-side proxy of a shard-side handler.  Owner-only (it writes
-- DDL that a DBA runs on the router); search_path is pinned, so every name
-- in its output is schema-qualified unless it is in pg_catalog.
CREATE FUNCTION idem_shard_router_ddl(handler regprocedure, routing_expr text,
                                      cluster text DEFAULT 'idem', split text[] DEFAULT NULL)
    RETURNS text
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    f           pg_proc;
    a           record;
    cols        text[] := '{}';
    split_used  boolean := false;
    uses_arg    boolean := false;
    refers      boolean;
    in_names    text[] := '{}';
    rtype       regtype;
    nsp         name;
    msg         text;
    ddl     text;
BEGIN
    IF handler IS NULL OR routing_expr IS NULL OR cluster IS NULL THEN
        RAISE EXCEPTION '% must not be null',
              CASE WHEN handler IS NULL THEN 'handler' WHEN routing_expr IS NULL THEN 'routing_expr' ELSE 'cluster' END
              USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF btrim(routing_expr) = '' OR cluster = '' THEN
        RAISE EXCEPTION '% must not be empty', CASE WHEN cluster = '' THEN 'cluster' ELSE 'routing_expr' END
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF routing_expr ~ '(;|--|/\*|\$plproxy\$)' OR routing_expr ~* '\mselect\M' THEN
        RAISE EXCEPTION 'routing_expr must be a single expression of the handler''s arguments'
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'Semicolons, comments and subqueries are not allowed.';
    END IF;
    SELECT * INTO f FROM pg_proc WHERE oid = handler;
    IF f.prokind <> 'f' THEN
        RAISE EXCEPTION '% is not a plain function', handler
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'PL/Proxy proxies functions, not procedures, aggregates or window functions.';
    END IF;
    IF EXISTS (SELECT FROM pg_language l WHERE l.oid = f.prolang AND l.lanname = 'plproxy') THEN
        RAISE EXCEPTION '% is a PL/Proxy function already', handler
              USING ERRCODE = 'invalid_parameter_value',
                    HINT = 'Run idem_shard_router_ddl() on a shard, with the shard-side handler.';
    END IF;
    IF f.prorettype = 'void'::regtype THEN
        RAISE EXCEPTION 'handler % returns void', handler
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'A PL/Proxy function must return a value; return whether the effect was applied.';
    END IF;
    IF split IS NOT NULL AND NOT f.proretset THEN
        RAISE EXCEPTION 'handler % must return SETOF to be split', handler
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'With SPLIT every partition that gets elements answers, so the proxy returns the rows of several calls.';
    END IF;
    IF split IS NOT NULL AND (cardinality(split) = 0 OR array_position(split, NULL) IS NOT NULL
                              OR cardinality(split) <> (SELECT count(DISTINCT s) FROM unnest(split) s)) THEN
        RAISE EXCEPTION 'split must list distinct argument names'
              USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- the input arguments, typed as the routing expression sees them (an
    -- element of a split array, each argument otherwise)
    FOR a IN
        SELECT x.t AS argtype, x.m AS mode, x.n AS name, x.i, ty.typelem, ty.typsubscript
          FROM unnest(coalesce(f.proallargtypes, f.proargtypes::oid[]),
                      coalesce(f.proargmodes, array_fill('i'::"char", ARRAY[f.pronargs::int])),
                      coalesce(f.proargnames, array_fill(NULL::text, ARRAY[f.pronargs::int])))
               WITH ORDINALITY AS x(t, m, n, i)
          JOIN pg_type ty ON ty.oid = x.t
         WHERE x.m IN ('i', 'b', 'v')
         ORDER BY x.i
    LOOP
        IF a.mode = 'v' THEN
            RAISE EXCEPTION 'handler % has a VARIADIC argument', handler
                  USING ERRCODE = 'invalid_parameter_value',
                        HINT = 'Proxy a function that takes a plain array instead.';
        END IF;
        IF coalesce(a.name, '') = '' THEN
            RAISE EXCEPTION 'argument % of % has no name', a.i, handler
                  USING ERRCODE = 'invalid_parameter_value',
                        DETAIL = 'The routing expression and PL/Proxy refer to arguments by name.';
        END IF;
        in_names := in_names || a.name::text;
        refers := routing_expr ~* ('(^|[^[:alnum:]_$."])'
                                   || regexp_replace(a.name, '([^[:alnum:]_])', '\\\1', 'g')
                                   || '($|[^[:alnum:]_$"])');
        uses_arg := uses_arg OR refers;
        IF a.name = ANY (split) THEN
            IF a.typsubscript <> 'array_subscript_handler'::regproc THEN
                RAISE EXCEPTION 'split argument % of % is not an array', a.name, handler
                      USING ERRCODE = 'invalid_parameter_value';
            END IF;
            split_used := split_used OR refers;
            cols := cols || format('NULL::%s AS %I', format_type(a.typelem, NULL), a.name);
        ELSE
            IF refers AND a.typsubscript = 'array_subscript_handler'::regproc THEN
                RAISE EXCEPTION 'routing_expr uses array argument % of % without splitting it', a.name, handler
                      USING ERRCODE = 'invalid_parameter_value',
                            DETAIL = 'The whole batch would go to the partition of one hash, whatever its elements.',
                            HINT = format('Name it in split, e.g. split => ARRAY[%L], so that each element goes to its own partition.', a.name);
            END IF;
            cols := cols || format('NULL::%s AS %I', format_type(a.argtype, NULL), a.name);
        END IF;
    END LOOP;
    IF split IS NOT NULL AND NOT split <@ in_names THEN
        RAISE EXCEPTION 'split names %, which is not an argument of %',
              (SELECT s FROM unnest(split) s WHERE s <> ALL (in_names) LIMIT 1), handler
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT uses_arg THEN
        RAISE EXCEPTION 'routing_expr uses no argument of %', handler
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'Every call would go to the same partition.';
    END IF;
    IF split IS NOT NULL AND NOT split_used THEN
        RAISE EXCEPTION 'routing_expr uses none of the split arguments'
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'With SPLIT each element is routed by itself, so the routing expression must use one.';
    END IF;

    -- parse and type the expression over the arguments, without running it:
    -- a temporary view of it, dropped at once
    BEGIN
        EXECUTE format('CREATE TEMPORARY VIEW idem_shard_route_check AS SELECT (%s) AS r FROM (SELECT %s) AS args',
                       routing_expr, array_to_string(cols, ', '));
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT;
        RAISE EXCEPTION 'routing_expr is not an expression of the arguments of %', handler
              USING ERRCODE = 'invalid_parameter_value', DETAIL = msg;
    END;
    SELECT t.atttypid INTO rtype FROM pg_attribute t
     WHERE t.attrelid = 'pg_temp.idem_shard_route_check'::regclass AND t.attnum = 1;
    DROP VIEW pg_temp.idem_shard_route_check;
    IF rtype <> 'text'::regtype THEN
        RAISE EXCEPTION 'routing_expr is of type %, not text', rtype
              USING ERRCODE = 'invalid_parameter_value',
                    HINT = 'Cast it, e.g. account_id::text, and pass the same text to idem_claim_routed() on the shard.';
    END IF;

    ddl := format(E'-- router-side proxy of %s, generated on database %I by idem_shard_router_ddl()\n',
                  handler, current_database());
    SELECT n.nspname INTO nsp FROM pg_namespace n WHERE n.oid = f.pronamespace;
    IF nsp <> 'public' THEN
        ddl := ddl || format(E'CREATE SCHEMA IF NOT EXISTS %I;\n', nsp);
    END IF;
    RETURN ddl || format(E'CREATE OR REPLACE FUNCTION %I.%I(%s)\n'
                         '    RETURNS %s\n'
                         '    LANGUAGE plproxy\n'
                         'AS $plproxy$\n'
                         '    CLUSTER %L;\n'
                         '%s'
                         '    RUN ON hashtext(%s);\n'
                         '$plproxy$;\n',
                         nsp, f.proname,
                         pg_get_function_arguments(handler), pg_get_function_result(handler),
                         cluster,
                         CASE WHEN split IS NULL THEN ''
                              ELSE format(E'    SPLIT %s;\n',
                                          (SELECT string_agg(quote_ident(s), ', ' ORDER BY o)
                                             FROM unnest(split) WITH ORDINALITY AS u(s, o)))
                         END,
                         routing_expr);
END
$fn$;
REVOKE ALL ON FUNCTION idem_shard_router_ddl(regprocedure, text, text, text[]) FROM PUBLIC;
COMMENT ON FUNCTION idem_shard_router_ddl(regprocedure, text, text, text[]) IS
    'router-side DDL: a PL/Proxy function of the handler''s signature, RUN ON hashtext(routing_expr), SPLIT the named arrays';

-- Router-side proxies that run everywhere: one row per shard (or per shard
-- and row), each naming the partitions its shard owns.
CREATE FUNCTION idem_shard_router_admin_ddl(cluster text DEFAULT 'idem', schema name DEFAULT 'idem_shards')
    RETURNS text
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    ext     text := (SELECT quote_ident(n.nspname) FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                      WHERE e.extname = 'idempotency');
    owned   constant text := '(SELECT so.owned FROM idempotency.shard_ownership AS so) AS owned';
    proxies text[][];
    ddl     text;
BEGIN
    IF cluster IS NULL OR schema IS NULL THEN
        RAISE EXCEPTION '% must not be null', CASE WHEN cluster IS NULL THEN 'cluster' ELSE 'schema' END
              USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF cluster = '' OR schema = '' THEN
        RAISE EXCEPTION '% must not be empty', CASE WHEN cluster = '' THEN 'cluster' ELSE 'schema' END
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- name(arguments), result, query on each shard
    proxies := ARRAY[
        ARRAY['ownership()',
              'TABLE(database text, partitions integer, owned integer[], frozen boolean)',
              'SELECT pg_catalog.current_database()::text AS database, so.partitions, so.owned, so.frozen'
              || ' FROM (SELECT) AS one LEFT JOIN idempotency.shard_ownership AS so ON true'],
        ARRAY['maintain()',
              'TABLE(owned integer[], action text, object text)',
              format('SELECT %s, m.action, m.object FROM %s.idem_maintain() AS m', owned, ext)],
        ARRAY['configure(retention interval DEFAULT NULL, partition_interval interval DEFAULT NULL, premake integer DEFAULT NULL)',
              'TABLE(owned integer[], configured boolean)',
              format('SELECT %s, true AS configured FROM %s.idem_configure(retention, partition_interval, premake) AS c',
                     owned, ext)],
        ARRAY['settings()',
              'TABLE(owned integer[], retention interval, partition_interval interval, premake integer)',
              format('SELECT %s, s.retention, s.partition_interval, s.premake FROM idempotency.current_settings() AS s',
                     owned)],
        ARRAY['claimed(key text, scope text DEFAULT ''default'')',
              'TABLE(owned integer[], claimed_at timestamp with time zone)',
              format('SELECT %s, %s.idem_claimed(key, scope) AS claimed_at', owned, ext)],
        ARRAY['stats()',
              'TABLE(owned integer[], scope text, relation text, claims bigint, duplicates bigint,'
              ' payload_mismatches bigint, stale_skips bigint, invalid_transitions bigint,'
              ' outbox_pending bigint, outbox_dead bigint,'
              ' last_claim_at timestamp with time zone, last_duplicate_at timestamp with time zone)',
              format('SELECT %s, st.scope::text AS scope, st.relation::text AS relation,'
                     ' st.claims::bigint AS claims, st.duplicates::bigint AS duplicates,'
                     ' st.payload_mismatches::bigint AS payload_mismatches, st.stale_skips::bigint AS stale_skips,'
                     ' st.invalid_transitions::bigint AS invalid_transitions,'
                     ' st.outbox_pending::bigint AS outbox_pending, st.outbox_dead::bigint AS outbox_dead,'
                     ' st.last_claim_at, st.last_duplicate_at FROM idempotency.stats AS st', owned)]];
    ddl := format(E'-- router-side admin proxies (RUN ON ALL), generated on database %I by idem_shard_router_admin_ddl()\n'
                  'CREATE SCHEMA IF NOT EXISTS %I;\n', current_database(), schema);
    FOR i IN 1 .. array_length(proxies, 1) LOOP
        ddl := ddl || format(E'CREATE OR REPLACE FUNCTION %I.%s\n'
                             '    RETURNS %s\n'
                             '    LANGUAGE plproxy\n'
                             'AS $plproxy$\n'
                             '    CLUSTER %L;\n'
                             '    RUN ON ALL;\n'
                             '    %s;\n'
                             '$plproxy$;\n',
                             schema, proxies[i][1], proxies[i][2], cluster, proxies[i][3]);
    END LOOP;
    RETURN ddl;
END
$fn$;
REVOKE ALL ON FUNCTION idem_shard_router_admin_ddl(text, name) FROM PUBLIC;
COMMENT ON FUNCTION idem_shard_router_admin_ddl(text, name) IS
    'router-side DDL: RUN ON ALL proxies (ownership, maintain, configure, settings, claimed, stats) in schema';
