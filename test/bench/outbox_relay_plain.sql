-- outbox bench, baseline relay: take up to :batch events in id order and
-- delete them, in one transaction (rows locked by another relay are skipped)
DELETE FROM bench_outbox
WHERE id IN (SELECT id FROM bench_outbox ORDER BY id LIMIT :batch FOR UPDATE SKIP LOCKED)
RETURNING id, aggregate_type, aggregate_id, type, payload, created_at;
