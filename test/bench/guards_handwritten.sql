-- baseline: the hand-written guard every handler would have to repeat
\set id random(1, 10000)
\set stale random(0, 4)
INSERT INTO guards_bench_hand AS t VALUES (:id, 'payload ' || :id,
    CASE WHEN :stale = 0 THEN 1 ELSE (extract(epoch FROM clock_timestamp()) * 1000000)::bigint END)
ON CONFLICT (id) DO UPDATE SET payload = EXCLUDED.payload, version = EXCLUDED.version
WHERE t.version < EXCLUDED.version;
