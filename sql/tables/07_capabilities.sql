-- Capabilities: the permission surface of the API (src/common/capabilities.c).
-- Application roles get capabilities with idem_grant(), never rights on our
-- tables; the API functions check them and then act as the extension's
-- owner.  See doc/reference.md, "Capabilities".
--
-- The table (run once); its trigger, the functions and the view are in
-- sql/functions/07_capabilities.sql.  New in 1.1: the update from 1.0 runs
-- this file (NEW_TABLES in the Makefile), and the two blocks at its end turn
-- 1.0's grants into capabilities (on a fresh install they find nothing: the
-- claims table and idem_maintain() are created later).

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
    subscriptions   text[],                     -- outbox subscriptions (relay, operator)
    PRIMARY KEY (role, capability)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.capabilities', '');

-- From 1.0: roles that held table privileges on idempotency.claims (INSERT
-- to claim, DELETE to release) get the capabilities instead, unlimited, and
-- lose every privilege on the table; a WARNING says so per role (not a
-- NOTICE: ALTER EXTENSION runs its scripts with client_min_messages at
-- warning, so a NOTICE would never be seen).  (A fresh
-- install creates the table later, in sql/tables/10_claims.sql.)
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
    -- the ACL a fresh install gives the table (sql/functions/10_claims.sql)
    IF pg_catalog.to_regclass('idempotency.claims') IS NOT NULL THEN
        REVOKE ALL ON idempotency.claims FROM PUBLIC;
    END IF;
END
$caps$;

-- From 1.0 as well: roles that may maintain through EXECUTE on
-- idem_maintain() (the update gives it to the role that owned the claims)
-- get the operator capability instead, and EXECUTE goes back to PUBLIC;
-- both functions check the capability.  (A fresh install creates them
-- later, in sql/functions/20_retention.sql.)
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
