-- outbox bench, candidate: 100 events in one transaction with one
-- idem_outbox_emit_many call.  Aggregates: 100 distinct ones of :aggregates,
-- stride 97 from a random start, offset per client (clients never share one)
\set a random(0, :aggregates - 1)
SELECT count(*) FROM idem_outbox_emit_many('order',
    ARRAY(SELECT (:client_id::bigint * 1000000 + (:a::int + g * 97) % :aggregates::int)::text
          FROM generate_series(1, 100) g),
    array_fill('created'::text, ARRAY[100]), array_fill('{"n":1}'::jsonb, ARRAY[100]));
