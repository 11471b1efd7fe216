-- candidate, duplicates: keys 1..10000 were claimed beforehand
\set k random(1, 10000)
SELECT idem_claim(:k::text);
