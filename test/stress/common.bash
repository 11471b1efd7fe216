# test/stress/common.bash: what the stress scripts share (sourced; not a
# test itself: test/run-tests runs only test/stress/*.sh).
#   $tmp          a temporary directory, removed on exit
#   bg_pids       background processes to kill on exit (append their pids)
#   sql ARGS      psql, quiet, unaligned, stopping at the first error
#   fail MSG      report a failed check (sets failed=1)
#   maintain_alongside
#                 run idem_maintain() every half second in the background
#                 (errors go to $tmp/maintain.err; maintain_stop checks it)
#   maintain_stop stop maintain_alongside; fail if idem_maintain() failed
#   pgbench_loop NAME SECONDS SCRIPT OUT [PGBENCH_ARGS...]
#                 one pgbench client looping SCRIPT for SECONDS in the
#                 background as application NAME (notices hidden), output
#                 to $tmp/OUT ($! is its pid)
#   pgbench_report LABEL OUT RC
#                 print the summary of pgbench's output $tmp/OUT; fail if
#                 its exit status RC is not 0 (a client got an error)
#   check_outputs FILE...
#                 fail for each pgbench output that reports an error
#   wait_drained SECONDS SQL
#                 poll SQL every half second until it returns t, for at
#                 most SECONDS; sets drained (t or f) and drain_secs
#   pgbench_end PCT_VAR [SQL]
#                 the end of a pgbench transaction script: when :r <= :PCT_VAR,
#                 run SQL (if given) and ROLLBACK, else COMMIT
#   terminate_mid_publish RELAY
#                 wait (up to 10 s) until relay RELAY (application relayRELAY)
#                 is idle right after publishing a non-empty batch (its last
#                 query an INSERT INTO consumer_log, its relay_batch rows
#                 there) and terminate its backend; sets killed_token (its
#                 lease token, or '' if it never got there)
#   expect_zero WHAT SQL [DETAIL_SQL]
#                 the query's single number must be 0; if not, also print
#                 up to 10 rows of DETAIL_SQL

tmp=$(mktemp -d)
bg_pids=()
cleanup() {
    local p
    for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT

sql() { psql -X -q -At -v ON_ERROR_STOP=1 "$@"; }
failed=0
fail() { echo "FAIL: $*"; failed=1; }
expect_zero() {
    local n
    n=$(sql -c "$2")
    if [[ $n != 0 ]]; then
        fail "$1: $n"
        sql -c "${3:-SELECT 'no detail query'}" | head -n 10 | sed 's/^/    /'
    else
        echo "ok: 0 $1"
    fi
}

terminate_mid_publish() {
    local kpid ktok end=$((SECONDS + 10))
    killed_token=''
    while ((SECONDS < end)); do
        # (two steps: a volatile function in the WHERE clause could be
        # evaluated before the other conditions, on any backend)
        read -r kpid ktok <<<"$(sql -F ' ' -c "
            SELECT t.pid, b.tok
            FROM (SELECT pid FROM pg_stat_activity
                  WHERE application_name = 'relay$1' AND state = 'idle'
                    AND query LIKE 'INSERT INTO consumer_log%') t,
                 (SELECT min(lease_token::text) AS tok, count(*) AS n FROM relay_batch WHERE relay = $1) b
            WHERE b.n > 0")"
        if [[ -n $kpid && $(sql -c "SELECT pg_terminate_backend($kpid)") == t ]]; then
            killed_token=$ktok
            return 0
        fi
        sleep 0.05
    done
}

pgbench_end() {
    printf '\\if :r <= :%s\n' "$1"
    [[ -n ${2:-} ]] && printf '%s\n' "$2"
    printf 'ROLLBACK;\n\\else\nCOMMIT;\n\\endif\n'
}

maintain_alongside() {
    (
        while :; do
            sql -c 'SELECT count(*) FROM idem_maintain()' >/dev/null 2>>"$tmp/maintain.err" \
                || echo "idem_maintain failed" >>"$tmp/maintain.err"
            sleep 0.5
        done
    ) &
    maintain_pid=$!
    bg_pids+=("$maintain_pid")
}

maintain_stop() {
    kill "$maintain_pid" 2>/dev/null || true
    if [[ -s $tmp/maintain.err ]]; then
        head -n 5 "$tmp/maintain.err"
        fail "idem_maintain() failed during the run"
    fi
}

pgbench_loop() {
    local name=$1 secs=$2 script=$3 out=$4
    shift 4
    PGAPPNAME=$name PGOPTIONS="$PGOPTIONS -c client_min_messages=warning" \
        pgbench -n -M extended -c 1 -T "$secs" "$@" -f "$script" >"$tmp/$out" 2>&1 &
}

pgbench_report() {
    grep -E 'processed|failed|tps|aborted' "$tmp/$2" | sed "s/^/  $1: /" || true
    [[ $3 -eq 0 ]] || { tail -n 20 "$tmp/$2"; fail "$1: pgbench exited with status $3 (a client got an error)"; }
}

check_outputs() {
    local f
    for f in "$@"; do
        [[ -e $f ]] || continue
        if grep -qE 'ERROR|aborted' "$f"; then
            grep -E "ERROR|DETAIL|aborted|error" "$f" | head -n 10 | sed "s/^/    /"
            fail "$(basename "$f" .out) reported an error"
        fi
    done
}

wait_drained() {
    local start=$SECONDS
    drained=f
    while ((SECONDS - start < $1)); do
        drained=$(sql -c "$2")
        [[ $drained == t ]] && break
        sleep 0.5
    done
    drain_secs=$((SECONDS - start))
}
