-- The shard side of the scale-out example: run in every shard database.
-- The handler is a function on the shard (its claim and its effects commit
-- together there); the router only forwards calls to it.  Its routing key
-- is account_id: the claim goes through idem_claim_routed, which refuses a
-- call whose account this database does not own (IK006) before claiming.
--
-- Used by examples/scale-out/run, test/tap/070_plproxy.pl and
-- test/bench/plproxy.sh, which run it as a superuser.  Any other role the
-- handlers run as (the router's connection strings name it, or PL/Proxy
-- connects as the calling user) needs USAGE on schema idempotency and
-- INSERT, SELECT on idempotency.claims (idem_claim_routed claims as
-- idem_claim does), and EXECUTE on idem_shard_assert(text) if a handler
-- calls the check by itself; idem_shard_configure() is for the owner of
-- idempotency.shard_ownership.
CREATE EXTENSION IF NOT EXISTS idempotency;

CREATE TABLE accounts (
    id      bigint PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0
);

-- one row per applied effect; no unique key on purpose, so that an effect
-- applied twice shows as a second row
CREATE TABLE effects (
    event_id   text NOT NULL,
    account_id bigint NOT NULL,
    amount     integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- events whose handler fails (tests of a batch failing halfway)
CREATE TABLE poison (event_id text PRIMARY KEY);

CREATE FUNCTION apply_payment(account_id bigint, event_id text, amount integer)
    RETURNS boolean
    LANGUAGE plpgsql AS
$$
BEGIN
    IF NOT idem_claim_routed(account_id::text, event_id, 'payments') THEN
        RETURN false;                   -- a redelivery: nothing to do
    END IF;
    IF EXISTS (SELECT FROM poison p WHERE p.event_id = apply_payment.event_id) THEN
        PERFORM pg_sleep(0.5);          -- fail after the other shards of a batch are done
        RAISE EXCEPTION 'event % is poisoned', event_id;
    END IF;
    INSERT INTO accounts AS a VALUES (account_id, amount)
        ON CONFLICT (id) DO UPDATE SET balance = a.balance + excluded.balance;
    INSERT INTO effects (event_id, account_id, amount) VALUES (event_id, account_id, amount);
    -- a follow-up event, relayed from this shard's outbox
    PERFORM idem_outbox_emit('account', account_id::text, 'payment_applied',
                             jsonb_build_object('event_id', event_id, 'amount', amount));
    RETURN true;
END
$$;

-- a batch: the router splits the arrays per shard (PL/Proxy SPLIT), each
-- shard applies its part in one transaction and returns the events it
-- applied; a retried batch applies only what had not committed
CREATE FUNCTION apply_batch(account_ids bigint[], event_ids text[], amounts integer[])
    RETURNS SETOF text
    LANGUAGE plpgsql AS
$$
BEGIN
    FOR i IN 1 .. cardinality(event_ids) LOOP
        IF apply_payment(account_ids[i], event_ids[i], amounts[i]) THEN
            RETURN NEXT event_ids[i];
        END IF;
    END LOOP;
END
$$;
