-- outbox bench, candidate relay of subscription :sub: claim up to :batch
-- events (one transaction), then ack them with the lease token (another);
-- when the claim came back
-- short and :idle > 0, sleep :idle ms before the next poll
SELECT count(*) AS n, coalesce(array_agg(id)::text, '{}') AS ids,
       coalesce(min(lease_token::text), '') AS token,
       coalesce(array_agg(payload)::text, '{}') AS payloads
FROM idem_outbox_claim(:batch, '30 seconds', NULL, :sub) \gset
\if :n > 0
SELECT idem_outbox_ack(:ids::uuid[], :token::uuid, :sub);
\endif
\if :n < :batch and :idle > 0
\sleep :idle ms
\endif
