-- candidate, duplicates: message ids 1..10000 were received beforehand
\set k random(1, 10000)
SELECT idem_inbox_receive('bench', :k::text, '{"n": 1}');
