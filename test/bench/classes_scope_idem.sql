-- candidate, new keys of a scope with a retention of its own (its own class)
\set k random(1, 9000000000000000000)
SELECT idem_claim(:k::text, 'hooks-stripe');
