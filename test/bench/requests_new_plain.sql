-- baseline, new keys: the hand-written insert of the request, then its completion
\set k random(1, 9000000000000000000)
INSERT INTO bench_requests (scope, key, digest, status, attempt, lease_until)
VALUES ('api', :k::text, sha256('{"amount": 10}'), 'started', 1, now() + interval '1 minute')
ON CONFLICT DO NOTHING;
UPDATE bench_requests SET status = 'completed', lease_until = NULL,
       response = '{"id": "pay", "amount": 10}', response_status = 201
 WHERE scope = 'api' AND key = :k::text AND status = 'started' AND attempt = 1;
