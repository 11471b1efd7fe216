-- examples/webhook-inbox: the application's tables, next to the extension.
-- psql -f schema.sql (as a superuser the first time: CREATE EXTENSION needs one)
CREATE EXTENSION IF NOT EXISTS idempotency;

-- the effect of a webhook: a ledger entry per message, and the balance of its
-- account.  No unique constraint on (source, message_id), on purpose: the
-- inbox alone keeps every message to one effect (the worker writes the entry
-- and marks the message done in one transaction).
CREATE TABLE IF NOT EXISTS ledger (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,   -- order applied
    source       text NOT NULL,
    message_id   text NOT NULL,
    account      text NOT NULL,
    amount       bigint NOT NULL,
    worker       text NOT NULL,
    applied_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS balances (
    account      text PRIMARY KEY,
    balance      bigint NOT NULL
);

-- the roles the receiver (idem-relay --in http) and the workers run as: the
-- receiver stores messages (handler) of the sources it serves, the workers
-- lease and settle them (relay) and write the ledger; neither has a right
-- on the extension's tables.  A new sender: its name here and in the
-- relay's --source.
DO $$
BEGIN
    CREATE ROLE webhook_receiver LOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END
$$;
DO $$
BEGIN
    CREATE ROLE webhook_worker LOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END
$$;
SELECT idem_grant('webhook_receiver', 'handler', sources => ARRAY['shop', 'billing', 'crm']);
SELECT idem_grant('webhook_worker', 'relay');
GRANT SELECT, INSERT ON ledger TO webhook_worker;
GRANT SELECT, INSERT, UPDATE ON balances TO webhook_worker;
