-- a redelivery of one of the events d1..d10000 applied beforehand
\set i random(1, 10000)
SELECT apply_payment(:i % 1000 + 1, 'd' || :i, 1);
