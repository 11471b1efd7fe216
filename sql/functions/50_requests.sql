-- Request idempotency: the idem_request_* functions and the partitions'
-- trigger (the tables, and how a request is stored, are in
-- sql/tables/50_requests.sql).  See src/delivery/requests.c.

COMMENT ON TABLE idempotency.requests IS
    'Idempotency-Key requests and their stored responses, in time partitions (see idem_request_begin())';

CREATE OR REPLACE TRIGGER request_partitions_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.request_partitions
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.request_partitions ENABLE ALWAYS TRIGGER request_partitions_changed;

CREATE OR REPLACE FUNCTION idem_request_begin(key text, scope text DEFAULT 'default', payload jsonb DEFAULT NULL,
                                              lease interval DEFAULT '1 minute', wait interval DEFAULT '0',
                                              on_conflict text DEFAULT 'error')
    RETURNS TABLE(status text, response jsonb, response_status integer, attempt integer,
                  recovery_point text, state jsonb, retry_after interval, replayed boolean,
                  response_body text, response_headers jsonb)
    AS 'MODULE_PATHNAME', 'idem_request_begin' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_request_checkpoint(key text, scope text, attempt integer, recovery_point text,
                                                   state jsonb DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_request_checkpoint' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_request_fence(key text, scope text, attempt integer)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_request_fence' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_request_extend(key text, scope text, attempt integer, lease interval)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_request_extend' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_request_complete(key text, scope text DEFAULT 'default', response jsonb DEFAULT NULL,
                                                 attempt integer DEFAULT NULL, response_status integer DEFAULT NULL,
                                                 response_body text DEFAULT NULL, response_headers jsonb DEFAULT NULL)
    RETURNS TABLE(status text, response jsonb, response_status integer, response_body text,
                  response_headers jsonb, replayed boolean)
    AS 'MODULE_PATHNAME', 'idem_request_complete' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_request_abandon(key text, scope text DEFAULT 'default', attempt integer DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_request_abandon' LANGUAGE C VOLATILE PARALLEL UNSAFE;
