#!/usr/bin/env bash
# test/stress/example_http_api.sh: examples/http-api end to end, over real HTTP.
#
# Starts the fake payment provider and the payments API (examples/http-api)
# on localhost, then:
#   1. functional checks: a new payment is 201 and its replays are the same
#      bytes; another body for the key is 422; no key / a bad key / a bad body
#      is 400; a decline is a stored 402; concurrent requests of one key make
#      one charge; a live lease held elsewhere gives 409 + Retry-After and is
#      taken over once it expires (the old holder is then fenced off: IK003);
#      a holder that stopped after charging is resumed from its recovery point
#      without calling the provider again; a provider timeout is 503 and
#      stores nothing;
#   2. stress: 50 concurrent clients send each of 500 keys 3-4 times
#      (shuffled, so copies of a key overlap), with a 1 s client timeout,
#      retrying on timeouts, 409 and 503 as Retry-After says, while the
#      provider hangs on 10 % of its requests and declines 5 % of new keys.
#      Checks: every key charged at most once at the provider (exactly once if
#      answered 201), one payments row per key matching the answer, every
#      201/402 of a key byte-identical to its first, the stored response of
#      every key equal to what was served, no key left without an answer.
# Exits non-zero on any failed check.  Connection from PGHOST/PGPORT/
# PGDATABASE/PGUSER (run by test/run-tests, part "stress", in an empty
# database).  Settings: IDEM_EXAMPLE_PORT (first of two TCP ports on
# 127.0.0.1; default: ports the system chooses), IDEM_EXAMPLE_KEYS (500),
# IDEM_EXAMPLE_CLIENTS (50), IDEM_PYTHON (python3 with psycopg2; default
# /usr/bin/python3).
set -euo pipefail

cd "$(dirname "$0")/../.."
EX=examples/http-api
. test/stress/examples.bash

# the API runs as the role schema.sql made, with the grants it shows and
# nothing else (the provider uses no database)
APP_ROLE=payments_api

# serve NAME PORT SCRIPT ARGS...: start an example server in the background
# (as APP_ROLE) and wait until it prints its URL; sets URL
serve() {
    local name=$1 port=$2
    shift 2
    PGUSER=$APP_ROLE "$PY" "$@" --port "$port" >"$tmp/$name.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do
        URL=$(grep -o 'http://[0-9.]*:[0-9]*' "$tmp/$name.log" | head -n 1 || true)
        [[ -n $URL ]] && return 0
        kill -0 "${pids[-1]}" 2>/dev/null || break
        sleep 0.1
    done
    echo "FAIL: $name did not start"
    exit 1
}
# stop_all: stop the servers started so far
stop_all() {
    local p
    for p in "${pids[@]}"; do
        { kill "$p" && wait "$p"; } 2>/dev/null || true
    done
    pids=()
}
port() { [[ $PORT == 0 ]] && echo 0 || echo $((PORT + $1)); }

psql -X -q -v ON_ERROR_STOP=1 -c 'SET client_min_messages = warning' -f "$EX/schema.sql"

cat >"$tmp/check.py" <<'PY'
import collections, json, queue, random, sys, threading, time, urllib.error, urllib.request
import psycopg2
from stress_checks import check, copies_queue, drain, exit_status, sql

phase, API, PROVIDER = sys.argv[1:4]

def post(key, body, timeout=5.0):
    """POST /payments; (status, body bytes, headers).  Timeouts raise."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(API + "/payments", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers

def charges():
    with urllib.request.urlopen(PROVIDER + "/charges", timeout=5) as r:
        return {c["key"]: c for c in json.loads(r.read())}

def sqlstate(query, *params):
    try:
        sql(query, *params)
        return None
    except psycopg2.Error as e:
        return e.pgcode

def functional():
    body = {"customer": "cus_1", "amount": 1250, "currency": "EUR"}
    st, b1, h = post("f-new", body)
    check(st == 201 and json.loads(b1)["status"] == "succeeded" and not h.get("Idempotent-Replayed"),
          f"a new payment is 201: {b1.decode()}")
    replays = [post("f-new", body) for _ in range(3)]
    check(all(r[0] == 201 and r[1] == b1 and r[2].get("Idempotent-Replayed") == "true" for r in replays),
          "3 replays are 201, byte-identical, marked Idempotent-Replayed")
    loc = h.get("Location")
    check(loc == "/payments/" + json.loads(b1)["id"] and all(r[2].get("Location") == loc for r in replays),
          f"the first answer's stored Location header ({loc}) comes with every replay")
    st, b, _ = post("f-new", b'{ "currency":"EUR",  "amount":1250, "customer":"cus_1" }')
    check(st == 201 and b == b1, "the same body in another JSON layout is the same request: replayed")
    st, b, _ = post("f-new", dict(body, amount=1251))
    check(st == 422, f"the key with another body is 422: {b.decode()}")
    results = [post(None, body)[0], post("", body)[0], post("x" * 2001, body)[0],
               post("f-bad", {"customer": "cus_1", "amount": -5, "currency": "EUR"})[0], post("f-bad", b"{")[0]]
    check(results == [400] * 5, f"no key, empty key, 2001-byte key, bad amount, bad JSON are 400: {results}")

    st, d1, _ = post("f-decline", {"customer": "cus_decline", "amount": 99, "currency": "EUR"})
    st2, d2, h2 = post("f-decline", {"customer": "cus_decline", "amount": 99, "currency": "EUR"})
    check(st == 402 and st2 == 402 and d1 == d2 and h2.get("Idempotent-Replayed") == "true",
          f"a decline is 402 and replayed byte-identical: {d1.decode()}")

    # 12 concurrent requests of one new key
    out, barrier = [], threading.Barrier(12)
    def one():
        barrier.wait()
        out.append(post("f-concurrent", {"customer": "cus_2", "amount": 700, "currency": "USD"}))
    threads = [threading.Thread(target=one) for _ in range(12)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    firsts = [r for r in out if r[0] == 201 and not r[2].get("Idempotent-Replayed")]
    replayed = [r for r in out if r[0] == 201 and r[2].get("Idempotent-Replayed") == "true"]
    busy = [r for r in out if r[0] == 409 and r[2].get("Retry-After")]
    c = charges().get("f-concurrent", {})
    check(len(firsts) == 1 and len(replayed) + len(busy) == 11 and all(r[1] == firsts[0][1] for r in replayed)
          and c.get("requests") == 1,
          f"12 concurrent requests of one key: 1 made it, {len(replayed)} waited and got the replay, "
          f"{len(busy)} got 409 with Retry-After; the provider saw 1 request")

    # a lease held elsewhere (a stuck holder): 409 with the remaining lease, then a takeover
    held = {"customer": "cus_3", "amount": 300, "currency": "EUR"}
    (attempt,), = sql("SELECT attempt FROM idem_request_begin('f-held', 'payments', %s, lease => '4 seconds')",
                      json.dumps(held))
    t0 = time.monotonic()
    st, b, h = post("f-held", held)
    waited = time.monotonic() - t0
    ra = h.get("Retry-After")
    check(st == 409 and ra is not None and 1 <= int(ra) <= 3 and waited >= 1.9,
          f"a live lease held elsewhere: 409 after waiting {waited:.1f} s, Retry-After: {ra} ({b.decode()})")
    time.sleep(int(ra or 2) + 0.2)
    st, b, h = post("f-held", held)
    check(st == 201, f"after Retry-After the expired lease is taken over: {st}")
    check(sqlstate("SELECT idem_request_complete('f-held', 'payments', '{}', %s, 200)", attempt) == "IK003",
          "the stuck holder's late complete (attempt 1) raises IK003")

    # a holder that charged, checkpointed and stopped: the next one resumes, no second provider call
    crashed = {"customer": "cus_4", "amount": 400, "currency": "EUR"}
    (attempt,), = sql("SELECT attempt FROM idem_request_begin('f-crashed', 'payments', %s, lease => '1 second')",
                      json.dumps(crashed))
    req = urllib.request.Request(PROVIDER + "/charges", data=json.dumps(crashed).encode(), method="POST",
                                 headers={"Idempotency-Key": "f-crashed", "Content-Type": "application/json"})
    charge = json.loads(urllib.request.urlopen(req, timeout=5).read())
    sql("SELECT idem_request_checkpoint('f-crashed', 'payments', %s, 'charged', %s)", attempt, json.dumps(charge))
    time.sleep(1.2)
    st, b, _ = post("f-crashed", crashed)
    check(st == 201 and json.loads(b)["charge_id"] == charge["id"] and charges()["f-crashed"]["requests"] == 1,
          f"a holder that stopped after charging is resumed at 'charged': 201 with its charge, "
          f"{charges()['f-crashed']['requests']} provider request in all")

    # the provider hangs: 503, nothing stored, a retry tries again
    hang = {"customer": "cus_timeout", "amount": 500, "currency": "EUR"}
    r1, r2 = post("f-timeout", hang), post("f-timeout", hang)
    (rows,), = sql("SELECT count(*) FROM payments WHERE key = 'f-timeout'")
    check(r1[0] == r2[0] == 503 and r1[2].get("Retry-After") == "1" and rows == 0,
          "a provider timeout is 503 with Retry-After: 1, twice (nothing stored, the retry called again)")
    (rows,), = sql("SELECT count(*) FROM payments")
    check(rows == 5, f"payments: {rows} rows (f-new, f-decline, f-concurrent, f-held, f-crashed)")

def stress(prefix, nkeys, nclients):
    rnd = random.Random(42)
    keys = [f"{prefix}-{i:04d}" for i in range(nkeys)]
    bodies = {k: {"customer": f"cus_{i % 37}", "amount": rnd.randint(100, 99999), "currency": "EUR"}
              for i, k in enumerate(keys)}
    tasks, ntasks = copies_queue(keys, 25, rnd)
    answers = collections.defaultdict(list)       # key -> [(status, body, replayed)]
    stats, lock = collections.Counter(), threading.Lock()
    def count(what):
        with lock:
            stats[what] += 1

    def client():
        for key in drain(tasks):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                count("requests")
                try:
                    st, b, h = post(key, bodies[key], timeout=1.0)
                except (OSError, urllib.error.URLError):   # timeout, reset: send again, after a
                    count("client timeouts")                # jittered pause as good clients do
                    time.sleep(random.uniform(0.1, 0.5))
                    continue
                if st in (201, 402):
                    with lock:
                        answers[key].append((st, b, h.get("Idempotent-Replayed") == "true"))
                    break
                if st in (409, 503) and h.get("Retry-After"):
                    count(f"{st} + Retry-After")
                    time.sleep(int(h["Retry-After"]))
                    continue
                count(f"unexpected {st}")
                print(f"unexpected answer for {key}: {st} {b[:200]!r}", flush=True)
                break
            else:
                count("gave up")

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(nclients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    elapsed = time.monotonic() - t0
    print("stress: %d keys, %d sends by %d clients in %.1f s: %s" % (
        nkeys, ntasks, nclients, elapsed, ", ".join(f"{n} {w}" for w, n in sorted(stats.items()))), flush=True)

    answered = sum(len(v) for v in answers.values())
    check(answered == ntasks and stats["gave up"] == 0 and not any(w.startswith("unexpected") for w in stats),
          f"{answered} of {ntasks} sends got a final 201/402 answer, none gave up or got anything else")
    same = [k for k in keys if answers[k] and all(a[:2] == answers[k][0][:2] for a in answers[k])]
    check(len(same) == nkeys, f"{len(same)} of {nkeys} keys: every 201/402 byte-identical to the first")
    firsts = collections.Counter(sum(not a[2] for a in answers[k]) for k in keys)
    check(all(n <= 1 for n in firsts),
          f"no key answered twice without Idempotent-Replayed (keys by fresh answers: {dict(sorted(firsts.items()))})")

    prov = charges()
    ok201 = [k for k in keys if answers[k] and answers[k][0][0] == 201]
    ok402 = [k for k in keys if answers[k] and answers[k][0][0] == 402]
    charged = [k for k in keys if prov.get(k, {}).get("http_status") == 201]
    match = [k for k in ok201 if prov.get(k, {}).get("id") == json.loads(answers[k][0][1])["charge_id"]]
    check(sorted(charged) == sorted(ok201) and len(match) == len(ok201),
          f"provider: {len(charged)} keys charged, exactly the {len(ok201)} answered 201, with the charge id "
          f"served; {len(ok402)} declined keys answered 402 and charged nothing")
    multi = sum(1 for k in keys if prov.get(k, {}).get("requests", 0) > 1)
    print(f"provider: {sum(c.get('requests', 0) for c in prov.values())} charge requests for "
          f"{len(prov)} keys; {multi} keys were sent more than once and charged once (its key dedup)")

    rows = {k: (s, c) for k, s, c in sql("SELECT key, status, charge_id FROM payments WHERE key LIKE %s", prefix + "-%")}
    good = [k for k in ok201 if rows.get(k) == ("succeeded", prov[k]["id"])] + \
           [k for k in ok402 if rows.get(k) == ("declined", None)]
    check(len(rows) == nkeys and len(good) == nkeys,
          f"payments: {len(rows)} rows for {nkeys} keys, {len(good)} matching the answer and the provider")

    stored = sql("""SELECT p.key, b.status, b.replayed, b.response_status, b.response_body
                    FROM payments p, idem_request_begin(p.key, 'payments', p.request) b
                    WHERE p.key LIKE %s""", prefix + "-%")
    same = [k for k, s, rp, rs, r in stored
            if s == "completed" and rp and (rs, r.encode()) == answers[k][0][:2]]
    check(len(same) == nkeys, f"{len(same)} of {nkeys} stored responses are 'completed' and equal to the answer served")

if phase == "functional":
    functional()
else:
    stress(phase, int(sys.argv[4]), int(sys.argv[5]))
sys.exit(exit_status())
PY

failed=0
echo "functional checks: provider without random failures"
serve provider "$(port 0)" "$EX/provider.py" --hang 1.5
provider=$URL
serve api "$(port 1)" "$EX/app.py" --provider "$provider"
"$PY" "$tmp/check.py" functional "$URL" "$provider" || failed=1
stop_all

echo "stress: provider hangs 10 % of requests (1.5 s, past the API's 0.7 s timeout), declines 5 % of new keys"
serve provider "$(port 0)" "$EX/provider.py" --hang 1.5 --timeout-rate 0.1 --decline-rate 0.05
provider=$URL
serve api "$(port 1)" "$EX/app.py" --provider "$provider" --pool 30
"$PY" "$tmp/check.py" s "$URL" "$provider" "${IDEM_EXAMPLE_KEYS:-500}" "${IDEM_EXAMPLE_CLIENTS:-50}" || failed=1
stop_all

echo "takeovers: the API's lease (0.25 s) is shorter than many provider calls (0.05-0.4 s): retries take over"
echo "from holders still at work, which then get IK003 (409); same provider failures"
serve provider "$(port 0)" "$EX/provider.py" --hang 1.5 --timeout-rate 0.1 --decline-rate 0.05
provider=$URL
serve api "$(port 1)" "$EX/app.py" --provider "$provider" --pool 30 --lease '0.25 seconds'
"$PY" "$tmp/check.py" t "$URL" "$provider" 200 25 || failed=1
echo "the API got IK003 (lease lost: taken over) $(grep -c 'lease lost' "$tmp/api.log" || true) times, answered 409"
stop_all

if [[ $failed -ne 0 ]]; then
    echo "FAILED"
    exit 1
fi
echo "all checks passed"
