-- the same claim behind the ownership check
\set account random(1, 1000)
\set ev random(1, 9000000000000000000)
SELECT idem_claim_routed(:account::text, 'c' || :ev, 'bench');
