-- candidate, replays: begin of a completed key returns the stored response
\set k random(1, 10000)
SELECT status, response, response_status FROM idem_request_begin(:k::text, 'api', '{"amount": 10}');
