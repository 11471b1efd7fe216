-- baseline of the ownership check: a plain claim of a new key
\set ev random(1, 9000000000000000000)
SELECT idem_claim('c' || :ev, 'bench');
