-- candidate, new messages: receive a message id from a huge range (almost never seen before)
\set k random(1, 9000000000000000000)
SELECT idem_inbox_receive('bench', :k::text, '{"n": 1}');
