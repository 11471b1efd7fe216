-- candidate: idem_upsert() of the row
\set id random(1, 10000)
\set stale random(0, 4)
SELECT idem_upsert(ROW(:id, 'payload ' || :id,
    CASE WHEN :stale = 0 THEN 1 ELSE (extract(epoch FROM clock_timestamp()) * 1000000)::bigint END)::guards_bench_idem);
