-- Dead letters as an operator sees them: idem_outbox_dead() and
-- idem_inbox_dead() give the rows of idempotency.outbox_dead and
-- idempotency.inbox_dead that the caller's operator capability covers,
-- with no right on the views or the schema.
CREATE EXTENSION idempotency;
SET idempotency.outbox_max_attempts = 1;
SET idempotency.inbox_max_attempts = 1;

-- two dead events (types order and invoice) and two dead messages
-- (sources stripe and github)
SELECT count(*) FROM (SELECT idem_outbox_emit('order', '1', 'paid', '{}')
                      UNION ALL SELECT idem_outbox_emit('invoice', '2', 'sent', '{}')) e;
SELECT count(*) FROM (SELECT idem_outbox_nack(id, 'boom', NULL, lease_token)
                      FROM idem_outbox_claim(10)) n;
SELECT idem_inbox_receive('stripe', 'm1', '{}') AND idem_inbox_receive('github', 'm2', '{}');
SELECT count(*) FROM (SELECT idem_inbox_fail(id, 'boom', NULL, lease_token)
                      FROM idem_inbox_claim(10)) f;

-- the owner sees everything
SELECT aggregate_type, aggregate_id, attempts, last_error FROM idem_outbox_dead() ORDER BY 1;
SELECT source, message_id, attempts, last_error FROM idem_inbox_dead() ORDER BY 1;

CREATE ROLE dl_none;
CREATE ROLE dl_ops;
CREATE ROLE dl_orders;
CREATE ROLE dl_relay;
SELECT idem_grant('dl_ops', 'operator');
SELECT idem_grant('dl_orders', 'operator', aggregate_types => ARRAY['ord*'], sources => ARRAY['stripe']);
SELECT idem_grant('dl_relay', 'relay');

\set VERBOSITY default
-- no capability, or another one: 42501 with the statement that grants it
SET ROLE dl_none;
SELECT count(*) FROM idem_outbox_dead();
SELECT count(*) FROM idem_inbox_dead();
SELECT count(*) FROM idempotency.outbox_dead;     -- and no right on the view
RESET ROLE;
SET ROLE dl_relay;
SELECT count(*) FROM idem_outbox_dead();
RESET ROLE;
\set VERBOSITY terse

-- an unlimited operator sees all of them
SET ROLE dl_ops;
SELECT aggregate_type, aggregate_id FROM idem_outbox_dead() ORDER BY 1;
SELECT source, message_id FROM idem_inbox_dead() ORDER BY 1;
RESET ROLE;

-- a limited operator sees only its types and sources, and redrives them
SET ROLE dl_orders;
SELECT aggregate_type, aggregate_id FROM idem_outbox_dead();
SELECT source, message_id FROM idem_inbox_dead();
SELECT idem_outbox_redrive(ARRAY(SELECT id FROM idem_outbox_dead()));
SELECT count(*) FROM idem_outbox_dead();
RESET ROLE;
SELECT aggregate_type FROM idem_outbox_dead();     -- the invoice is still dead

SET client_min_messages = warning;
SELECT idem_revoke(r::regrole) FROM unnest(ARRAY['dl_ops', 'dl_orders', 'dl_relay']) r \g /dev/null
DROP EXTENSION idempotency CASCADE;
DROP ROLE dl_none, dl_ops, dl_orders, dl_relay;
RESET client_min_messages;
