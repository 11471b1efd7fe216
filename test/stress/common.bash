# test/stress/common.bash: what the stress scripts share (sourced; not a
# test itself: test/run-tests runs only test/stress/*.sh).
#   $tmp          a temporary directory, removed on exit
#   bg_pids       background processes to kill on exit (append their pids)
#   sql ARGS      psql, quiet, unaligned, stopping at the first error
#   fail MSG      report a failed check (sets failed=1)
#   maintain_alongside
#                 run idem_maintain() every half second in the background
#                 (errors go to $tmp/maintain.err, which the caller checks)
#   pgbench_end PCT_VAR [SQL]
#                 the end of a pgbench transaction script: when :r <= :PCT_VAR,
#                 run SQL (if given) and ROLLBACK, else COMMIT
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
    bg_pids+=($!)
}
