-- Scale-out with PL/Proxy: the shard ownership guard and the generator of
-- router-side DDL.  See src/shards/shards.c and README "Scale-out".

GRANT SELECT ON idempotency.shard_ownership TO PUBLIC;
COMMENT ON TABLE idempotency.shard_ownership IS
    'which PL/Proxy hash partitions this database owns (set with idem_shard_configure())';

-- Every backend caches the row; any change tells them all to read it again.
-- ENABLE ALWAYS: a change made with session_replication_role = replica too.
CREATE OR REPLACE FUNCTION idempotency.shard_changed() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_shard_changed' LANGUAGE C;
REVOKE ALL ON FUNCTION idempotency.shard_changed() FROM PUBLIC;
CREATE OR REPLACE TRIGGER shard_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.shard_ownership
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.shard_changed();
ALTER TABLE idempotency.shard_ownership ENABLE ALWAYS TRIGGER shard_changed;

CREATE OR REPLACE FUNCTION idem_shard_configure(partitions integer, owned integer[], frozen boolean DEFAULT false)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_shard_configure' LANGUAGE C VOLATILE;

CREATE OR REPLACE FUNCTION idem_shard_partition(routing_key text, partitions integer)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_shard_partition' LANGUAGE C IMMUTABLE PARALLEL SAFE;

CREATE OR REPLACE FUNCTION idem_shard_assert(routing_key text)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_shard_assert' LANGUAGE C VOLATILE PARALLEL RESTRICTED;

CREATE OR REPLACE FUNCTION idem_claim_routed(routing_key text, key text, scope text DEFAULT 'default',
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

-- What the generators below put into router-side DDL.  Text that a lesser
-- role may have chosen (the names of a handler, of its schema, arguments
-- and types, a cluster) goes there only as a quoted identifier or literal,
-- never in a comment, and never with a control character.
CREATE OR REPLACE FUNCTION idempotency.shard_ddl_text(what text, value text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF value ~ E'[\\x01-\\x1f\\x7f]' THEN
        RAISE EXCEPTION '% contains a control character', what
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'Newlines, tabs and other characters below 0x20 and 0x7f are refused in text that reaches generated DDL.';
    END IF;
    RETURN value;
END
$fn$;
REVOKE ALL ON FUNCTION idempotency.shard_ddl_text(text, text) FROM PUBLIC;

-- A PL/Proxy body (ending in a newline) quoted with a dollar tag that does
-- not occur in it: $plproxy$, or $plproxy_1$, ...
CREATE OR REPLACE FUNCTION idempotency.shard_dollar_quoted(body text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    tag text := '$plproxy$';
    n   integer := 0;
BEGIN
    WHILE strpos(body, tag) > 0 LOOP
        n := n + 1;
        tag := format('$plproxy_%s$', n);
    END LOOP;
    RETURN tag || E'\n' || body || tag;
END
$fn$;
REVOKE ALL ON FUNCTION idempotency.shard_dollar_quoted(text) FROM PUBLIC;

-- The CLUSTER statement of a PL/Proxy body: the name as a standard string
-- literal, the only form PL/Proxy reads (whatever standard_conforming_strings).
CREATE OR REPLACE FUNCTION idempotency.shard_cluster_statement(cluster text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT
    SET search_path = pg_catalog, pg_temp
    RETURN E'    CLUSTER ''' || replace(idempotency.shard_ddl_text('cluster', cluster), '''', '''''') || E''';\n';
REVOKE ALL ON FUNCTION idempotency.shard_cluster_statement(text) FROM PUBLIC;

-- The routing expression, checked on its parse tree as PostgreSQL and
-- PL/Proxy will read it on the router (src/shards/shards.c): the input arguments
-- it uses (1-based positions in names) and its type.
CREATE OR REPLACE FUNCTION idempotency.shard_routing_check(routing_expr text, names text[], types regtype[],
                                                           OUT args integer[], OUT type regtype)
    AS 'MODULE_PATHNAME', 'idem_shard_routing_check' LANGUAGE C STABLE;
REVOKE ALL ON FUNCTION idempotency.shard_routing_check(text, text[], regtype[]) FROM PUBLIC;

-- The router-side proxy of a shard-side handler.  Owner-only (it writes
-- DDL that a DBA runs on the router); search_path is pinned, so every name
-- in its output is schema-qualified unless it is in pg_catalog.
CREATE OR REPLACE FUNCTION idem_shard_router_ddl(handler regprocedure, routing_expr text,
                                                 cluster text DEFAULT 'idem', split text[] DEFAULT NULL)
    RETURNS text
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    f           pg_proc;
    a           record;
    nsp         name;
    in_names    text[] := '{}';
    in_types    regtype[] := '{}';
    in_arrays   boolean[] := '{}';
    checked     record;
    msg         text;
    ddl         text;
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
    SELECT * INTO f FROM pg_proc WHERE oid = handler;
    SELECT n.nspname INTO nsp FROM pg_namespace n WHERE n.oid = f.pronamespace;
    -- the handler's names reach the DDL: refused with a control character
    -- (the messages do not repeat such a name)
    PERFORM idempotency.shard_ddl_text('the schema name of the handler', nsp),
            idempotency.shard_ddl_text('the name of the handler', f.proname),
            idempotency.shard_ddl_text('an argument of the handler', pg_get_function_arguments(handler)),
            idempotency.shard_ddl_text('the result of the handler', pg_get_function_result(handler));
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
        IF a.name = ANY (split) AND a.typsubscript <> 'array_subscript_handler'::regproc THEN
            RAISE EXCEPTION 'split argument % of % is not an array', a.name, handler
                  USING ERRCODE = 'invalid_parameter_value';
        END IF;
        in_names := in_names || a.name::text;
        in_types := in_types || CASE WHEN a.name = ANY (split) THEN a.typelem ELSE a.argtype END::regtype;
        in_arrays := in_arrays || (a.typsubscript = 'array_subscript_handler'::regproc AND a.name <> ALL (coalesce(split, '{}')));
    END LOOP;
    IF split IS NOT NULL AND NOT split <@ in_names THEN
        RAISE EXCEPTION 'split names %, which is not an argument of %',
              (SELECT s FROM unnest(split) s WHERE s <> ALL (in_names) LIMIT 1), handler
              USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- parse and type the expression over the arguments, as the router will
    -- (without running it); its own refusals keep their message
    BEGIN
        SELECT * INTO checked FROM idempotency.shard_routing_check(routing_expr, in_names, in_types);
    EXCEPTION
        WHEN invalid_parameter_value THEN
            RAISE;
        WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT;
            RAISE EXCEPTION 'routing_expr is not an expression of the arguments of %', handler
                  USING ERRCODE = 'invalid_parameter_value', DETAIL = msg;
    END;
    IF cardinality(checked.args) = 0 THEN
        RAISE EXCEPTION 'routing_expr uses no argument of %', handler
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'Every call would go to the same partition.';
    END IF;
    FOR i IN 1 .. cardinality(checked.args) LOOP
        IF in_arrays[checked.args[i]] THEN
            RAISE EXCEPTION 'routing_expr uses array argument % of % without splitting it', in_names[checked.args[i]], handler
                  USING ERRCODE = 'invalid_parameter_value',
                        DETAIL = 'The whole batch would go to the partition of one hash, whatever its elements.',
                        HINT = format('Name it in split, e.g. split => ARRAY[%L], so that each element goes to its own partition.',
                                      in_names[checked.args[i]]);
        END IF;
    END LOOP;
    IF split IS NOT NULL AND NOT EXISTS (SELECT FROM unnest(checked.args) u(i) WHERE in_names[u.i] = ANY (split)) THEN
        RAISE EXCEPTION 'routing_expr uses none of the split arguments'
              USING ERRCODE = 'invalid_parameter_value',
                    DETAIL = 'With SPLIT each element is routed by itself, so the routing expression must use one.';
    END IF;
    IF checked.type <> 'text'::regtype THEN
        RAISE EXCEPTION 'routing_expr is of type %, not text', checked.type
              USING ERRCODE = 'invalid_parameter_value',
                    HINT = 'Cast it, e.g. account_id::text, and pass the same text to idem_claim_routed() on the shard.';
    END IF;

    -- no names in the comment; the body in a dollar quote it cannot end;
    -- a split argument by its plain name where PL/Proxy reads that as the
    -- argument (a lower-case word, no PL/Proxy keyword, no other argument
    -- equal to it but for case), by position ($n) otherwise
    ddl := E'-- router-side proxy, generated by idem_shard_router_ddl()\n';
    IF nsp <> 'public' THEN
        ddl := ddl || format(E'CREATE SCHEMA IF NOT EXISTS %I;\n', nsp);
    END IF;
    RETURN ddl || format(E'CREATE OR REPLACE FUNCTION %I.%I(%s)\n'
                         '    RETURNS %s\n'
                         '    LANGUAGE plproxy\n'
                         'AS %s;\n',
                         nsp, f.proname,
                         pg_get_function_arguments(handler), pg_get_function_result(handler),
                         idempotency.shard_dollar_quoted(
                             idempotency.shard_cluster_statement(cluster)
                             || CASE WHEN split IS NULL THEN ''
                                     ELSE format(E'    SPLIT %s;\n',
                                                 (SELECT string_agg(
                                                             CASE WHEN s ~ '^[a-z_][a-z0-9_]*$'
                                                                       AND s <> ALL ('{cluster,connect,run,on,all,any,split,target,select}')
                                                                       AND (SELECT count(*) FROM unnest(in_names) n WHERE lower(n) = s) = 1
                                                                  THEN s
                                                                  ELSE '$' || array_position(in_names, s)
                                                             END, ', ' ORDER BY o)
                                                    FROM unnest(split) WITH ORDINALITY AS u(s, o)))
                                END
                             || format(E'    RUN ON hashtext(%s);\n', routing_expr)));
END
$fn$;
REVOKE ALL ON FUNCTION idem_shard_router_ddl(regprocedure, text, text, text[]) FROM PUBLIC;
COMMENT ON FUNCTION idem_shard_router_ddl(regprocedure, text, text, text[]) IS
    'router-side DDL: a PL/Proxy function of the handler''s signature, RUN ON hashtext(routing_expr), SPLIT the named arrays';

-- Router-side proxies that run everywhere: one row per shard (or per shard
-- and row), each naming the partitions its shard owns.
CREATE OR REPLACE FUNCTION idem_shard_router_admin_ddl(cluster text DEFAULT 'idem', schema name DEFAULT 'idem_shards')
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
    PERFORM idempotency.shard_ddl_text('schema', schema),
            idempotency.shard_ddl_text('the schema name of extension idempotency', ext);
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
        ARRAY['configure_scope(scope text, retention interval)',
              'TABLE(owned integer[], configured boolean)',
              format('SELECT %s, true AS configured FROM %s.idem_configure_scope(scope, retention) AS c',
                     owned, ext)],
        ARRAY['configure_store(store text, retention interval)',
              'TABLE(owned integer[], configured boolean)',
              format('SELECT %s, true AS configured FROM %s.idem_configure_store(store, retention) AS c',
                     owned, ext)],
        ARRAY['store_settings()',
              'TABLE(owned integer[], store text, retention interval, own boolean)',
              format('SELECT %s, s.store, s.retention, s.own FROM idempotency.current_store_settings() AS s',
                     owned)],
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
    ddl := format(E'-- router-side admin proxies (RUN ON ALL), generated by idem_shard_router_admin_ddl()\n'
                  'CREATE SCHEMA IF NOT EXISTS %I;\n', schema);
    FOR i IN 1 .. array_length(proxies, 1) LOOP
        ddl := ddl || format(E'CREATE OR REPLACE FUNCTION %I.%s\n'
                             '    RETURNS %s\n'
                             '    LANGUAGE plproxy\n'
                             'AS %s;\n',
                             schema, proxies[i][1], proxies[i][2],
                             idempotency.shard_dollar_quoted(idempotency.shard_cluster_statement(cluster)
                                                             || format(E'    RUN ON ALL;\n    %s;\n', proxies[i][3])));
    END LOOP;
    RETURN ddl;
END
$fn$;
REVOKE ALL ON FUNCTION idem_shard_router_admin_ddl(text, name) FROM PUBLIC;
COMMENT ON FUNCTION idem_shard_router_admin_ddl(text, name) IS
    'router-side DDL: RUN ON ALL proxies (ownership, maintain, configure, configure_scope, configure_store, settings, store_settings, claimed, stats) in schema';
