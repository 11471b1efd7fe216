-- baseline, duplicates: keys 1..10000 were inserted beforehand
\set k random(1, 10000)
INSERT INTO bench_plain (scope, key) VALUES ('default', :k::text) ON CONFLICT DO NOTHING;
