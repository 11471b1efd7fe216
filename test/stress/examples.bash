# test/stress/examples.bash: what the tests of the examples share (sourced;
# not a test itself; the request snapshot stress test uses it too).  Sets PY
# (a python3 with psycopg2) and PORT (the first port to serve on, 0: any),
# puts test/stress on PYTHONPATH (for stress_checks.py), makes $tmp
# (removed on exit) and kills the pids in pids() on exit, showing the tail
# of every $tmp/*.log if the test failed.

PY=${IDEM_PYTHON:-/usr/bin/python3}
[[ -x $PY ]] || PY=python3
"$PY" -c 'import psycopg2' || { echo "FAIL: $PY cannot import psycopg2 (Debian: python3-psycopg2)"; exit 1; }
PORT=${IDEM_EXAMPLE_PORT:-0}
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"

tmp=$(mktemp -d)
pids=()
cleanup() {
    local rc=$? p
    set +e
    for p in "${pids[@]}"; do
        { kill "$p" && wait "$p"; } 2>/dev/null
    done
    if [[ $rc -ne 0 ]]; then
        for p in "$tmp"/*.log; do
            [[ -s $p ]] && { echo "----- $(basename "$p") (last 20 lines)"; tail -n 20 "$p"; }
        done
    fi
    rm -rf "$tmp"
    return "$rc"
}
trap cleanup EXIT
