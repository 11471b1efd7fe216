-- Testing handlers (SPEC section 8): replay a handler's events shuffled,
-- with duplicates and simulated crashes, and compare the final state with
-- an in-order reference run.  Everything runs in subtransactions that are
-- rolled back, so the database is left as it was.
--
-- These run with the caller's privileges and on the caller's search_path
-- (the handler and state_query are the caller's own code), so they are
-- not SECURITY DEFINER and do not pin search_path; what they call of their
-- own is schema-qualified.  A deterministic generator (a 31-bit linear
-- congruential one, seeded by "seed") makes runs reproducible without
-- touching the session's random().
--
-- What a rollback does not undo is put back after every run (the
-- reference run is run 0): the session advisory locks the handler took,
-- the statements it prepared, the sequences it advanced (so every run
-- hands out the same values) -- a sequence only if no other session took
-- a value since this one's last, else it is left advanced, with a
-- WARNING.  Counters: the function runs with idempotency.stats_sandbox on
-- (src/stats/stats.c), so nothing its runs count reaches idempotency.stats.

CREATE OR REPLACE FUNCTION idem_check_replay(handler regprocedure, events jsonb[], state_query text,
                                             runs integer DEFAULT 20, duplicate_rate float8 DEFAULT 0.3,
                                             crash_rate float8 DEFAULT 0.1, seed integer DEFAULT 0)
    RETURNS TABLE(run integer, deliveries integer, ok boolean, difference text)
    LANGUAGE plpgsql VOLATILE
    -- the runs' payload mismatches, conflicts and guarded-write refusals
    -- count only if they commit, as their claims do: never (src/stats/stats.c)
    SET idempotency.stats_sandbox = on
AS $fn$
DECLARE
    -- a delivery that fails this often in one run fails the run
    max_failures constant integer := 5;
    sentinel constant text := 'idempotency replay: roll back';
    n integer;
    rng bigint;
    call text;
    reference text[];
    got text[];
    queue integer[];
    failures integer[];
    pos integer;
    ev integer;
    j integer;
    tmp integer;
    crash boolean;
    failed_msg text;
    failed_code text;
    failed_hint text;
    err text;
    msg text;
    missing text[];
    extra text[];
    -- what a rollback does not undo, as it was before the call: put back
    -- after every run
    locks_before text[];
    statements_before text[];
    sequences_before jsonb;
    lk record;
    sq record;
    st text;
    ours boolean;
    released boolean;
    key8 bigint;
    k1 integer;
    k2 integer;
BEGIN
    IF handler IS NULL OR events IS NULL OR state_query IS NULL OR runs IS NULL
       OR duplicate_rate IS NULL OR crash_rate IS NULL OR seed IS NULL THEN
        RAISE EXCEPTION 'idem_check_replay arguments must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    n := coalesce(pg_catalog.array_length(events, 1), 0);
    IF n = 0 OR pg_catalog.array_ndims(events) <> 1 THEN
        RAISE EXCEPTION 'events must be a non-empty one-dimensional array'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.array_position(events, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'events must not contain null elements'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.btrim(state_query) = '' THEN
        RAISE EXCEPTION 'state_query must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF runs < 1 OR runs > 10000 THEN
        RAISE EXCEPTION 'runs must be between 1 and 10000'
            USING ERRCODE = 'invalid_parameter_value', DETAIL = pg_catalog.format('%s was given.', runs);
    END IF;
    IF NOT (duplicate_rate >= 0 AND duplicate_rate < 1 AND crash_rate >= 0 AND crash_rate < 1) THEN
        RAISE EXCEPTION 'duplicate_rate and crash_rate must be at least 0 and below 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF (SELECT p.pronargs <> 1 OR p.proargtypes[0] <> 'pg_catalog.jsonb'::pg_catalog.regtype
          FROM pg_catalog.pg_proc p WHERE p.oid = handler) THEN
        RAISE EXCEPTION 'handler % must take one jsonb argument', handler
            USING ERRCODE = 'datatype_mismatch';
    END IF;

    call := pg_catalog.format('SELECT %s($1)', handler::pg_catalog.regproc);
    state_query := pg_catalog.format(
        'SELECT coalesce(pg_catalog.array_agg(r::text ORDER BY r::text), ''{}'') FROM (%s) r',
        state_query);

    -- this session's advisory locks, its prepared statements, and the
    -- sequences it may put back (setval needs UPDATE; reading, SELECT or
    -- USAGE; another session's temporary ones cannot be read)
    locks_before := ARRAY(
        SELECT pg_catalog.format('%s/%s/%s/%s', l.classid, l.objid, l.objsubid, l.mode)
          FROM pg_catalog.pg_locks l
         WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid());
    statements_before := ARRAY(SELECT s.name FROM pg_catalog.pg_prepared_statements s);
    sequences_before := (
        SELECT coalesce(pg_catalog.jsonb_object_agg(q.seqrelid::text, pg_catalog.pg_sequence_last_value(q.seqrelid)), '{}')
          FROM pg_catalog.pg_sequence q JOIN pg_catalog.pg_class c ON c.oid = q.seqrelid
         WHERE (c.relpersistence <> 't' OR c.relnamespace = pg_catalog.pg_my_temp_schema())
           AND pg_catalog.has_sequence_privilege(q.seqrelid, 'UPDATE')
           AND pg_catalog.has_sequence_privilege(q.seqrelid, 'SELECT, USAGE'));

    rng := pg_catalog.abs(seed::bigint) % 2147483648;
    -- run 0 is the reference: every event once, in order
    FOR r IN 0 .. runs LOOP
        run := r;
        deliveries := 0;
        failed_msg := NULL;
        failed_hint := NULL;
        got := NULL;
        queue := ARRAY(SELECT g FROM pg_catalog.generate_series(1, n) g);
        IF r > 0 THEN
            -- the events shuffled (Fisher-Yates)
            FOR i IN REVERSE n .. 2 LOOP
                rng := (rng * 1103515245 + 12345) % 2147483648;
                j := (rng % i)::integer + 1;
                tmp := queue[i]; queue[i] := queue[j]; queue[j] := tmp;
            END LOOP;
        END IF;
        failures := pg_catalog.array_fill(0, ARRAY[n]);
        BEGIN
            pos := 1;
            WHILE pos <= pg_catalog.array_length(queue, 1) LOOP
                ev := queue[pos];
                deliveries := deliveries + 1;
                crash := false;
                IF r > 0 THEN
                    rng := (rng * 1103515245 + 12345) % 2147483648;
                    crash := (rng::float8 / 2147483648) < crash_rate;
                END IF;
                BEGIN
                    EXECUTE call USING events[ev];
                    IF crash THEN
                        RAISE EXCEPTION USING MESSAGE = sentinel;
                    END IF;
                EXCEPTION WHEN OTHERS THEN
                    GET STACKED DIAGNOSTICS err = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
                    IF msg <> sentinel AND r = 0 THEN
                        failed_msg := pg_catalog.format('the handler failed in the reference run, on event %s: %s', ev, msg);
                        failed_code := err;
                        failed_hint := 'The reference run applies every event once, in order; it must succeed.';
                        EXIT;
                    ELSIF msg <> sentinel THEN
                        failures[ev] := failures[ev] + 1;
                        IF failures[ev] >= max_failures THEN
                            failed_msg := pg_catalog.format('event %s failed %s times: %s', ev, failures[ev], msg);
                            EXIT;
                        END IF;
                    END IF;
                    crash := true;      -- it comes again later
                END;
                IF r > 0 AND NOT crash THEN
                    -- a redelivery of what succeeded
                    rng := (rng * 1103515245 + 12345) % 2147483648;
                    crash := (rng::float8 / 2147483648) < duplicate_rate;
                END IF;
                IF crash THEN
                    rng := (rng * 1103515245 + 12345) % 2147483648;
                    j := pos + 1 + (rng % (pg_catalog.array_length(queue, 1) - pos + 1))::integer;
                    queue := queue[1:j - 1] || ev || queue[j:];
                END IF;
                pos := pos + 1;
            END LOOP;
            IF failed_msg IS NULL THEN
                EXECUTE state_query INTO got;
            END IF;
            RAISE EXCEPTION USING MESSAGE = sentinel;
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS err = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
            IF msg <> sentinel AND r = 0 THEN
                failed_msg := pg_catalog.format('state_query failed after the reference run: %s', msg);
                failed_code := err;
            ELSIF msg <> sentinel THEN
                failed_msg := coalesce(failed_msg, msg);
            END IF;
        END;

        -- put back what the rollback did not undo: session advisory locks
        -- (as often as they were taken; objsubid 1 and 2 are the SQL
        -- functions', the others the extension's own) ...
        FOR lk IN SELECT DISTINCT l.classid, l.objid, l.objsubid, l.mode
                    FROM pg_catalog.pg_locks l
                   WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid()
                     AND l.objsubid IN (1, 2)
                     AND pg_catalog.format('%s/%s/%s/%s', l.classid, l.objid, l.objsubid, l.mode)
                         <> ALL (locks_before)
        LOOP
            -- the key: one bigint in two halves, or two integers
            key8 := (lk.classid::bigint << 32) | lk.objid::bigint;
            k1 := (lk.classid::bigint - CASE WHEN lk.classid::bigint > 2147483647 THEN 4294967296 ELSE 0 END)::integer;
            k2 := (lk.objid::bigint - CASE WHEN lk.objid::bigint > 2147483647 THEN 4294967296 ELSE 0 END)::integer;
            LOOP
                released := CASE WHEN lk.objsubid = 1 AND lk.mode = 'ShareLock' THEN pg_catalog.pg_advisory_unlock_shared(key8)
                                 WHEN lk.objsubid = 1 THEN pg_catalog.pg_advisory_unlock(key8)
                                 WHEN lk.mode = 'ShareLock' THEN pg_catalog.pg_advisory_unlock_shared(k1, k2)
                                 ELSE pg_catalog.pg_advisory_unlock(k1, k2) END;
                EXIT WHEN NOT released OR NOT EXISTS (
                    SELECT 1 FROM pg_catalog.pg_locks l
                     WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid()
                       AND l.classid = lk.classid AND l.objid = lk.objid
                       AND l.objsubid = lk.objsubid AND l.mode = lk.mode);
            END LOOP;
        END LOOP;
        -- ... prepared statements ...
        FOR st IN SELECT s.name FROM pg_catalog.pg_prepared_statements s
                   WHERE s.name <> ALL (statements_before) LOOP
            EXECUTE pg_catalog.format('DEALLOCATE %I', st);
        END LOOP;
        -- ... and sequences, unless another session took a value since
        -- this one's last (putting it back would hand that value out again)
        FOR sq IN SELECT b.key::oid::regclass AS seq, (b.value #>> '{}')::bigint AS was, q.seqstart,
                         pg_catalog.pg_sequence_last_value(b.key::oid::regclass) AS now
                    FROM pg_catalog.jsonb_each(sequences_before) b
                    JOIN pg_catalog.pg_sequence q ON q.seqrelid = b.key::oid
        LOOP
            CONTINUE WHEN sq.now IS NOT DISTINCT FROM sq.was;
            BEGIN
                ours := pg_catalog.currval(sq.seq) = sq.now;
            EXCEPTION WHEN object_not_in_prerequisite_state THEN
                ours := false;
            END;
            IF NOT ours THEN
                RAISE WARNING 'sequence % was advanced by another session during the replay, so it is left where it is', sq.seq
                    USING DETAIL = 'Putting it back would hand out again values another session took.';
            ELSIF sq.was IS NULL THEN
                PERFORM pg_catalog.setval(sq.seq, sq.seqstart, false);
            ELSE
                PERFORM pg_catalog.setval(sq.seq, sq.was, true);
            END IF;
        END LOOP;

        IF r = 0 THEN
            IF failed_msg IS NOT NULL AND failed_hint IS NOT NULL THEN
                RAISE EXCEPTION USING MESSAGE = failed_msg, ERRCODE = failed_code, HINT = failed_hint;
            ELSIF failed_msg IS NOT NULL THEN
                RAISE EXCEPTION USING MESSAGE = failed_msg, ERRCODE = failed_code;
            END IF;
            reference := got;
            CONTINUE;
        END IF;
        IF failed_msg IS NOT NULL THEN
            ok := false;
            difference := failed_msg;
        ELSE
            missing := ARRAY(SELECT d.x FROM (SELECT pg_catalog.unnest(reference)
                                              EXCEPT ALL SELECT pg_catalog.unnest(got)) d(x) ORDER BY d.x COLLATE "C");
            extra := ARRAY(SELECT d.x FROM (SELECT pg_catalog.unnest(got)
                                            EXCEPT ALL SELECT pg_catalog.unnest(reference)) d(x) ORDER BY d.x COLLATE "C");
            ok := pg_catalog.cardinality(missing) = 0 AND pg_catalog.cardinality(extra) = 0;
            difference := CASE WHEN ok THEN NULL ELSE pg_catalog.concat_ws('; ',
                CASE WHEN pg_catalog.cardinality(missing) > 0 THEN pg_catalog.format('missing %s row(s): %s',
                    pg_catalog.cardinality(missing), pg_catalog.array_to_string(missing[1:3], ', ')) END,
                CASE WHEN pg_catalog.cardinality(extra) > 0 THEN pg_catalog.format('unexpected %s row(s): %s',
                    pg_catalog.cardinality(extra), pg_catalog.array_to_string(extra[1:3], ', ')) END) END;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$fn$;
COMMENT ON FUNCTION idem_check_replay(regprocedure, jsonb[], text, integer, float8, float8, integer) IS
    'replay a handler''s events shuffled, with duplicates and crashes, and compare with the in-order run (all rolled back)';

CREATE OR REPLACE FUNCTION idem_is_replay_safe(handler regprocedure, events jsonb[], state_query text,
                                               description text DEFAULT NULL)
    RETURNS text
    LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    total integer := 0;
    bad integer := 0;
    r record;
    line text;
    tap text;
BEGIN
    IF pg_catalog.to_regprocedure('ok(boolean,text)') IS NULL
       OR pg_catalog.to_regprocedure('diag(text)') IS NULL THEN
        RAISE EXCEPTION 'idem_is_replay_safe needs pgTAP'
            USING ERRCODE = 'undefined_function',
                  HINT = 'CREATE EXTENSION pgtap, with its schema on search_path; or call idem_check_replay().';
    END IF;
    FOR r IN SELECT * FROM idem_check_replay(handler, events, state_query) LOOP
        total := total + 1;
        IF NOT r.ok THEN
            bad := bad + 1;
            IF bad = 1 THEN
                line := pg_catalog.format('run %s (seed 0) after %s deliveries: %s',
                                          r.run, r.deliveries, r.difference);
            END IF;
        END IF;
    END LOOP;
    EXECUTE 'SELECT ok($1, $2)'
        INTO tap
        USING bad = 0, coalesce(description, pg_catalog.format('%s is replay-safe', handler));
    IF bad = 0 THEN
        RETURN tap;
    END IF;
    EXECUTE 'SELECT diag($1)' INTO line
        USING pg_catalog.format('%s of %s runs differ from the in-order run; the first, %s', bad, total, line);
    RETURN tap || E'\n' || line;
END
$fn$;
COMMENT ON FUNCTION idem_is_replay_safe(regprocedure, jsonb[], text, text) IS
    'pgTAP assertion: idem_check_replay() finds no run that differs from the in-order run';
