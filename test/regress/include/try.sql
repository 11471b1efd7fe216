-- pg_temp.try(sql): run one statement and report, in a form that is stable
-- across verbosity settings: the first value a query returns, as text ('ok'
-- for a command, or a query whose value is empty or null), or
-- 'SQLSTATE: message' if it fails.  Shared by the regression tests.
CREATE FUNCTION pg_temp.try(sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE r text;
BEGIN
    IF sql ~* '^\s*(select|values|with)\M' THEN
        EXECUTE sql INTO r;
    ELSE
        EXECUTE sql;
    END IF;
    RETURN coalesce(nullif(r, ''), 'ok');
EXCEPTION WHEN OTHERS THEN
    RETURN SQLSTATE || ': ' || SQLERRM;
END
$$;
