-- candidate, new keys: claim a key from a huge range (almost never seen before)
\set k random(1, 9000000000000000000)
SELECT idem_claim(:k::text);
