-- Request idempotency: stored responses for HTTP-style Idempotency-Key
-- requests whose work spans several transactions (SPEC section 5).  The
-- tables; the functions and the partitions' trigger are in
-- sql/functions/50_requests.sql.
--
-- A request is a claim in scope 'request:<scope>' (so the same uniqueness
-- and retention as claims) plus one row of idempotency.requests that holds
-- its state: the holder's attempt and lease, the last recovery point and
-- state, and once completed the response.  The rows live in time partitions
-- (LIST on "bucket", like the outbox's events, made and dropped by the
-- maintenance round); a row is updated in place while its request runs and
-- never deleted.  See src/delivery/requests.c.

CREATE TABLE idempotency.requests (
    scope           text COLLATE "C" NOT NULL,
    key             text COLLATE "C" NOT NULL,
    digest          bytea,                    -- SHA-256 of the canonical payload
    status          text NOT NULL,            -- started, completed, abandoned
    attempt         integer NOT NULL,         -- the fencing token; never repeats
    lease_until     timestamptz,
    recovery_point  text,
    state           jsonb,
    response        jsonb,                    -- the body, when given as jsonb
    response_status integer,
    response_body   text,                     -- the body, when given as text
    response_headers jsonb,                   -- {"name": "value" or ["value", ...]}, names lower case
    created_at      timestamptz NOT NULL,
    updated_at      timestamptz NOT NULL,
    bucket          integer NOT NULL,         -- the partition it went into
    CHECK (response IS NULL OR response_body IS NULL)
) PARTITION BY LIST (bucket);

-- The partitions, as maintenance made them (like outbox_partitions).
CREATE TABLE idempotency.request_partitions (
    relid  regclass    PRIMARY KEY,
    bucket integer     NOT NULL UNIQUE,
    lower  timestamptz NOT NULL,
    upper  timestamptz NOT NULL,
    CHECK (lower < upper)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.request_partitions', '');
