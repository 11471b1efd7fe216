-- outbox bench, PgQ consumer "relay" of queue "bench": the next batch, its
-- events, finish.  With no batch ready: when :tick is 1, ask pgq.ticker()
-- for a tick (it makes one once ticker_max_count events are pending or
-- ticker_max_lag has passed); without a new tick, sleep :idle ms
SELECT coalesce(pgq.next_batch('bench', 'relay'), 0) AS batch \gset
\if :batch > 0
SELECT count(*) AS n, array_agg(ev_id) AS ids, array_agg(ev_data) AS payloads
FROM pgq.get_batch_events(:batch);
SELECT pgq.finish_batch(:batch);
\else
\set newtick 0
\if :tick
SELECT coalesce(pgq.ticker('bench'), 0) AS newtick \gset
\endif
\if :newtick = 0 and :idle > 0
\sleep :idle ms
\endif
\endif
