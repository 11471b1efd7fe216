-- baseline, new keys: the hand-written dedup insert on a plain primary-key table
\set k random(1, 9000000000000000000)
INSERT INTO bench_plain (scope, key) VALUES ('default', :k::text) ON CONFLICT DO NOTHING;
