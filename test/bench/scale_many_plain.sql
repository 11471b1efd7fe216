-- scale bench, baseline: insert the same 1000 keys into the plain table; returns the new ones
\set k random(:lo, :hi)
INSERT INTO bench_plain (scope, key)
SELECT 'default', k FROM unnest(ARRAY(SELECT (:k::bigint + g)::text FROM generate_series(0, 999) g)) k
ON CONFLICT DO NOTHING RETURNING key;
