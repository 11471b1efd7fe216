-- baseline, duplicates: message ids 1..10000 were claimed (scope inbox:plain) and stored beforehand
\set k random(1, 10000)
INSERT INTO bench_inbox_plain (source, message_id, payload, headers)
SELECT 'plain', :k::text, '{"n": 1}', '{}' WHERE idem_claim(:k::text, :scope, '{"n": 1}');
