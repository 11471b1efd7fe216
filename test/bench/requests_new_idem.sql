-- candidate, new keys: begin (its own transaction), then complete
\set k random(1, 9000000000000000000)
SELECT status FROM idem_request_begin(:k::text, 'api', '{"amount": 10}');
SELECT idem_request_complete(:k::text, 'api', '{"id": "pay", "amount": 10}', 1, 201);
