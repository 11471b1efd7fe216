-- scale bench, candidate: claim one key drawn from [lo, hi] (pgbench -D lo=... -D hi=...)
\set k random(:lo, :hi)
SELECT idem_claim(:k::text);
