-- baseline, replays: the insert finds the key, the response is read back
\set k random(1, 10000)
INSERT INTO bench_requests (scope, key, digest, status, attempt, lease_until)
VALUES ('api', :k::text, sha256('{"amount": 10}'), 'started', 1, now() + interval '1 minute')
ON CONFLICT DO NOTHING;
SELECT status, response, response_status FROM bench_requests WHERE scope = 'api' AND key = :k::text;
