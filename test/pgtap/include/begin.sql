-- The pgTAP tests' common start, included first (\ir include/begin.sql) by
-- every test/pgtap/*.sql: one transaction (the test rolls it back at its
-- end), pgTAP and the extension created in it, without their notices.
BEGIN;
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS pgtap;
CREATE EXTENSION IF NOT EXISTS idempotency;
