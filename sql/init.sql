-- First partitions, so that claims work right after CREATE EXTENSION.
SELECT count(*) FROM idem_maintain();
