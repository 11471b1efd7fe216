-- baseline, new messages with an ordering key: the claim, the key's counter, the message, in one statement
\set k random(1, 9000000000000000000)
\set o random(1, 1000)
WITH c AS (SELECT idem_claim(:k::text, :scope, '{"n": 1}') AS new),
     s AS (INSERT INTO bench_inbox_seq AS q (ordering_key, last_seq) SELECT :o::text, 1 FROM c WHERE new
           ON CONFLICT (ordering_key) DO UPDATE SET last_seq = q.last_seq + 1 RETURNING last_seq)
INSERT INTO bench_inbox_plain (source, message_id, ordering_key, seq, payload, headers)
SELECT 'plain', :k::text, :o::text, s.last_seq, '{"n": 1}', jsonb_build_object('ordering_key', :o::text) FROM s;
