-- Capabilities: the permission surface of the API (src/common/capabilities.c).
-- Application roles get capabilities with idem_grant(), never rights on our
-- tables; the API functions check them and then act as the extension's
-- owner.  See doc/reference.md, "Capabilities".
--
-- New in 1.1: the upgrade script from 1.0 includes this file whole, and the
-- block at its end turns 1.0's table grants on idempotency.claims into
-- capabilities (on a fresh install it finds none).

-- One row per (role, capability).  NULL limit: unlimited on that axis; an
-- entry is an exact name or a prefix ending in '*'; an empty array allows
-- nothing on that axis.  role is a regrole, so that a dump names the role
-- and a restore into another cluster finds that cluster's role of that name.
CREATE TABLE idempotency.capabilities (
    role            regrole NOT NULL,
    capability      text NOT NULL
                    CHECK (capability IN ('handler', 'relay', 'operator', 'monitor')),
    scopes          text[],
    aggregate_types text[],
    sources         text[],
    PRIMARY KEY (role, capability)
);
COMMENT ON TABLE idempotency.capabilities IS
    'capabilities granted with idem_grant(): role, capability and its limits';
SELECT pg_catalog.pg_extension_config_dump('idempotency.capabilities', '');
REVOKE ALL ON idempotency.capabilities FROM PUBLIC;

-- Every backend caches the table (src/common/capabilities.c).
CREATE TRIGGER capabilities_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.capabilities
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.capabilities ENABLE ALWAYS TRIGGER capabilities_changed;

CREATE FUNCTION idem_grant(role regrole, capability text, scopes text[] DEFAULT NULL,
                           aggregate_types text[] DEFAULT NULL, sources text[] DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_grant' LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_revoke(role regrole, capability text DEFAULT NULL)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_revoke' LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_grant(regrole, text, text[], text[], text[]),
                       idem_revoke(regrole, text) FROM PUBLIC;

-- The monitor capability is view access: idem_grant(r, 'monitor') gives r
-- the privileges pg_monitor holds on the extension's objects (the views and
-- the functions behind them, granted at the end of 65_stats.sql: the one
-- list) and USAGE on schema idempotency; idem_revoke() takes them back.
-- Internal: run by idem_grant()/idem_revoke() as the extension's owner,
-- with a role name that regrole output quotes.
CREATE FUNCTION idempotency.monitor_privileges(target regrole, give boolean)
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
CREATE VIEW idempotency.capability_grants AS
SELECT c.role::pg_catalog.text AS role, c.capability, c.scopes, c.aggregate_types, c.sources
FROM idempotency.capabilities c
WHERE EXISTS (SELECT FROM pg_catalog.pg_roles r
              WHERE r.oid OPERATOR(pg_catalog.=) c.role::pg_catalog.oid);
COMMENT ON VIEW idempotency.capability_grants IS
    'capabilities granted with idem_grant(), with their limits';
REVOKE ALL ON idempotency.capability_grants FROM PUBLIC;
GRANT SELECT ON idempotency.capability_grants TO pg_monitor;

-- From 1.0: roles that held table privileges on idempotency.claims (INSERT
-- to claim, DELETE to release) get the capabilities instead, unlimited, and
-- lose every privilege on the table; a WARNING says so per role (not a
-- NOTICE: ALTER EXTENSION runs its scripts with client_min_messages at
-- warning, so a NOTICE would never be seen).  (A fresh
-- install creates the table later, in 10_claims.sql.)
DO $caps$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::pg_catalog.regrole AS grantee,
               pg_catalog.bool_or(a.privilege_type = 'INSERT') AS ins,
               pg_catalog.bool_or(a.privilege_type = 'DELETE') AS del,
               pg_catalog.string_agg(a.privilege_type, ', ' ORDER BY a.privilege_type) AS privs
        FROM pg_catalog.pg_class c,
             LATERAL pg_catalog.aclexplode(c.relacl) a
        WHERE c.oid = pg_catalog.to_regclass('idempotency.claims')
          AND a.grantee <> c.relowner AND a.grantee <> 0
        GROUP BY a.grantee
    LOOP
        IF r.ins THEN
            INSERT INTO idempotency.capabilities (role, capability) VALUES (r.grantee, 'handler')
            ON CONFLICT DO NOTHING;
        END IF;
        IF r.del THEN
            INSERT INTO idempotency.capabilities (role, capability) VALUES (r.grantee, 'operator')
            ON CONFLICT DO NOTHING;
        END IF;
        EXECUTE pg_catalog.format('REVOKE ALL ON idempotency.claims FROM %s', r.grantee);
        RAISE WARNING 'role % held % on idempotency.claims: granted capability %; its table privileges are revoked',
            r.grantee, r.privs,
            pg_catalog.concat_ws(' and ', CASE WHEN r.ins THEN 'handler' END,
                                 CASE WHEN r.del THEN 'operator' END,
                                 CASE WHEN NOT (r.ins OR r.del) THEN 'none' END);
    END LOOP;
    -- the ACL a fresh install gives the table (10_claims.sql)
    IF pg_catalog.to_regclass('idempotency.claims') IS NOT NULL THEN
        REVOKE ALL ON idempotency.claims FROM PUBLIC;
    END IF;
END
$caps$;

-- From 1.0 as well: roles that may maintain through EXECUTE on
-- idem_maintain() (the update gives it to the role that owned the claims)
-- get the operator capability instead, and EXECUTE goes back to PUBLIC;
-- both functions check the capability.  (A fresh install creates them
-- later, in 20_retention.sql.)
DO $caps$
DECLARE
    r record;
BEGIN
    IF pg_catalog.to_regprocedure('idem_maintain()') IS NULL THEN
        RETURN;
    END IF;
    FOR r IN
        SELECT DISTINCT a.grantee::pg_catalog.regrole AS grantee
        FROM pg_catalog.pg_proc p, LATERAL pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid IN ('idem_maintain()'::pg_catalog.regprocedure,
                        'idem_configure(interval, interval, integer)'::pg_catalog.regprocedure)
          AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        INSERT INTO idempotency.capabilities (role, capability) VALUES (r.grantee, 'operator')
        ON CONFLICT (role, capability) DO UPDATE
            SET scopes = NULL, aggregate_types = NULL, sources = NULL;
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION idem_maintain(), idem_configure(interval, interval, integer) FROM %s',
                                  r.grantee);
        RAISE WARNING 'role % held EXECUTE on idem_maintain(): granted capability operator', r.grantee;
    END LOOP;
    REVOKE ALL ON FUNCTION idem_configure(interval, interval, integer), idem_maintain() FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION idem_configure(interval, interval, integer), idem_maintain() TO PUBLIC;
END
$caps$;
