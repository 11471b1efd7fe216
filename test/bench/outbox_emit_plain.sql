-- outbox bench, baseline: one event into the hand-written outbox table
\set a random(1, :aggregates)
INSERT INTO bench_outbox (aggregate_type, aggregate_id, type, payload)
VALUES ('order', :a::text, 'created', '{"n":1}');
