-- scale bench, baseline: the dedup insert of one key drawn from [lo, hi] into the plain table
\set k random(:lo, :hi)
INSERT INTO bench_plain (scope, key) VALUES ('default', :k::text) ON CONFLICT DO NOTHING;
