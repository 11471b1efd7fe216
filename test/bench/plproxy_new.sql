-- a new event for one of 1000 accounts (through the router or direct)
\set account random(1, 1000)
\set ev random(1, 9000000000000000000)
SELECT apply_payment(:account, 'n' || :ev, 1);
