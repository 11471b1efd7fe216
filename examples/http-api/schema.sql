-- examples/http-api: the application's own table, next to the extension.
-- psql -f schema.sql (as a superuser the first time: CREATE EXTENSION needs one)
CREATE EXTENSION IF NOT EXISTS idempotency;

-- one row per payment request that reached a final outcome; written in the
-- same transaction as idem_request_complete, after idem_request_fence
CREATE TABLE IF NOT EXISTS payments (
    id         bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    key        text PRIMARY KEY,                 -- the Idempotency-Key
    customer   text NOT NULL,
    amount     bigint NOT NULL CHECK (amount > 0),
    currency   text NOT NULL,
    status     text NOT NULL CHECK (status IN ('succeeded', 'declined')),
    charge_id  text,                             -- the provider's charge, if succeeded
    request    jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- the role the API runs as: its own table, and the handler capability
-- limited to the API's scope; no right on the extension's tables
DO $$
BEGIN
    CREATE ROLE payments_api LOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END
$$;
GRANT SELECT, INSERT ON payments TO payments_api;
SELECT idem_grant('payments_api', 'handler', scopes => ARRAY['payments']);
