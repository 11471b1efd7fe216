-- scale bench, candidate: claim 1000 consecutive keys starting in [lo, hi]; returns the new ones
\set k random(:lo, :hi)
SELECT k FROM idem_claim_many(ARRAY(SELECT (:k::bigint + g)::text FROM generate_series(0, 999) g)) k;
