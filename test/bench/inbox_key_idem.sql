-- candidate, new messages with an ordering key (one of 1000): receive stores it with the key's next seq
\set k random(1, 9000000000000000000)
\set o random(1, 1000)
SELECT idem_inbox_receive('bench', :k::text, '{"n": 1}', jsonb_build_object('ordering_key', :o::text));
