-- outbox bench, PgQ: one event into queue "bench" (aggregate in ev_extra1/ev_extra2)
\set a random(1, :aggregates)
SELECT pgq.insert_event('bench', 'created', '{"n":1}', 'order', :a::text, NULL, NULL);
