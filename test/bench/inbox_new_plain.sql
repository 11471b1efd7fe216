-- baseline, new messages: the same claim (inbox.sh passes the scope, inbox:bench), then the
-- message into a plain table, in one statement
\set k random(1, 9000000000000000000)
INSERT INTO bench_inbox_plain (source, message_id, payload, headers)
SELECT 'bench', :k::text, '{"n": 1}', '{}' WHERE idem_claim(:k::text, :scope, '{"n": 1}');
