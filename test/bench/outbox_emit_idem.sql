-- outbox bench, candidate: one event with idem_outbox_emit
\set a random(1, :aggregates)
SELECT idem_outbox_emit('order', :a::text, 'created', '{"n":1}');
