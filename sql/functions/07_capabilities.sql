-- Capabilities: idem_grant(), idem_revoke(), the view of who holds what and
-- the cache trigger of the table (the table is in
-- sql/tables/07_capabilities.sql; the checks in src/common/capabilities.c).
-- Application roles get capabilities, never rights on our tables; the API
-- functions check them and then act as the extension's owner.  See
-- doc/reference.md, "Capabilities".

COMMENT ON TABLE idempotency.capabilities IS
    'capabilities granted with idem_grant(): role, capability and its limits';
REVOKE ALL ON idempotency.capabilities FROM PUBLIC;

-- Every backend caches the table (src/common/capabilities.c).
CREATE OR REPLACE TRIGGER capabilities_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.capabilities
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.capabilities ENABLE ALWAYS TRIGGER capabilities_changed;

CREATE OR REPLACE FUNCTION idem_grant(role regrole, capability text, scopes text[] DEFAULT NULL,
                           aggregate_types text[] DEFAULT NULL, sources text[] DEFAULT NULL,
                           subscriptions text[] DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_grant' LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE OR REPLACE FUNCTION idem_revoke(role regrole, capability text DEFAULT NULL)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_revoke' LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_grant(regrole, text, text[], text[], text[], text[]),
                       idem_revoke(regrole, text) FROM PUBLIC;

-- The monitor capability is view access: idem_grant(r, 'monitor') gives r
-- the privileges pg_monitor holds on the extension's objects (the views and
-- the functions behind them, granted at the end of 65_stats.sql: the one
-- list) and USAGE on schema idempotency; idem_revoke() takes them back.
-- Internal: run by idem_grant()/idem_revoke() as the extension's owner,
-- with a role name that regrole output quotes.
CREATE OR REPLACE FUNCTION idempotency.monitor_privileges(target regrole, give boolean)
    RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS
$$
DECLARE
    o record;
BEGIN
    FOR o IN
        SELECT d.classid, d.objid, a.privilege_type
        FROM pg_catalog.pg_depend d
        JOIN pg_catalog.pg_extension e ON e.oid = d.refobjid AND e.extname = 'idempotency'
        LEFT JOIN pg_catalog.pg_class c
               ON d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND c.oid = d.objid
        LEFT JOIN pg_catalog.pg_proc p
               ON d.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND p.oid = d.objid,
        LATERAL pg_catalog.aclexplode(coalesce(c.relacl, p.proacl)) a
        WHERE d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.deptype = 'e'
          AND a.grantee = 'pg_monitor'::pg_catalog.regrole
        ORDER BY 1, 2, 3
    LOOP
        IF o.classid = 'pg_catalog.pg_class'::pg_catalog.regclass THEN
            EXECUTE pg_catalog.format(CASE WHEN give THEN 'GRANT %s ON %s TO %s' ELSE 'REVOKE %s ON %s FROM %s' END,
                                      o.privilege_type, o.objid::pg_catalog.regclass, target);
        ELSE
            EXECUTE pg_catalog.format(CASE WHEN give THEN 'GRANT %s ON FUNCTION %s TO %s' ELSE 'REVOKE %s ON FUNCTION %s FROM %s' END,
                                      o.privilege_type, o.objid::pg_catalog.regprocedure, target);
        END IF;
    END LOOP;
    EXECUTE pg_catalog.format(CASE WHEN give THEN 'GRANT USAGE ON SCHEMA idempotency TO %s'
                                   ELSE 'REVOKE USAGE ON SCHEMA idempotency FROM %s' END, target);
END
$$;
REVOKE ALL ON FUNCTION idempotency.monitor_privileges(regrole, boolean) FROM PUBLIC;

-- Who holds what, for owners and pg_monitor; rows of dropped roles left out.
CREATE OR REPLACE VIEW idempotency.capability_grants AS
SELECT c.role::pg_catalog.text AS role, c.capability, c.scopes, c.aggregate_types, c.sources,
       c.subscriptions
FROM idempotency.capabilities c
WHERE EXISTS (SELECT FROM pg_catalog.pg_roles r
              WHERE r.oid OPERATOR(pg_catalog.=) c.role::pg_catalog.oid);
COMMENT ON VIEW idempotency.capability_grants IS
    'capabilities granted with idem_grant(), with their limits';
REVOKE ALL ON idempotency.capability_grants FROM PUBLIC;
GRANT SELECT ON idempotency.capability_grants TO pg_monitor;

