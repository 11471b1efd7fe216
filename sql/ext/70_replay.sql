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
-- This file is new in 1.1: the upgrade script from 1.0 includes it whole
-- (see the Makefile), so it must only create objects.

CREATE FUNCTION idem_check_replay(handler regprocedure, events jsonb[], state_query text,
                                  runs integer DEFAULT 20, duplicate_rate float8 DEFAULT 0.3,
                                  crash_rate float8 DEFAULT 0.1, seed integer DEFAULT 0)
    RETURNS TABLE(run integer, deliveries integer, ok boolean, difference text)
    LANGUAGE plpgsql VOLATILE
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
    err text;
    msg text;
    missing text[];
    extra text[];
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

    -- the reference: every event once, in order
    BEGIN
        FOR i IN 1 .. n LOOP
            ev := i;
            EXECUTE call USING events[i];
        END LOOP;
        ev := 0;
        EXECUTE state_query INTO reference;
        RAISE EXCEPTION USING MESSAGE = sentinel;
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS err = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
        IF msg <> sentinel AND ev = 0 THEN
            RAISE EXCEPTION 'state_query failed after the reference run: %', msg USING ERRCODE = err;
        ELSIF msg <> sentinel THEN
            RAISE EXCEPTION 'the handler failed in the reference run, on event %: %', ev, msg
                USING ERRCODE = err,
                      HINT = 'The reference run applies every event once, in order; it must succeed.';
        END IF;
    END;

    rng := pg_catalog.abs(seed::bigint) % 2147483648;
    FOR r IN 1 .. runs LOOP
        run := r;
        deliveries := 0;
        failed_msg := NULL;
        got := NULL;
        -- the events shuffled (Fisher-Yates)
        queue := ARRAY(SELECT g FROM pg_catalog.generate_series(1, n) g);
        FOR i IN REVERSE n .. 2 LOOP
            rng := (rng * 1103515245 + 12345) % 2147483648;
            j := (rng % i)::integer + 1;
            tmp := queue[i]; queue[i] := queue[j]; queue[j] := tmp;
        END LOOP;
        failures := pg_catalog.array_fill(0, ARRAY[n]);
        BEGIN
            pos := 1;
            WHILE pos <= pg_catalog.array_length(queue, 1) LOOP
                ev := queue[pos];
                deliveries := deliveries + 1;
                rng := (rng * 1103515245 + 12345) % 2147483648;
                crash := (rng::float8 / 2147483648) < crash_rate;
                BEGIN
                    EXECUTE call USING events[ev];
                    IF crash THEN
                        RAISE EXCEPTION USING MESSAGE = sentinel;
                    END IF;
                EXCEPTION WHEN OTHERS THEN
                    GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT;
                    IF msg <> sentinel THEN
                        failures[ev] := failures[ev] + 1;
                        IF failures[ev] >= max_failures THEN
                            failed_msg := pg_catalog.format('event %s failed %s times: %s', ev, failures[ev], msg);
                            EXIT;
                        END IF;
                    END IF;
                    crash := true;      -- it comes again later
                END;
                IF NOT crash THEN
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
            GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT;
            IF msg <> sentinel THEN
                failed_msg := coalesce(failed_msg, msg);
            END IF;
        END;
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

CREATE FUNCTION idem_is_replay_safe(handler regprocedure, events jsonb[], state_query text,
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
