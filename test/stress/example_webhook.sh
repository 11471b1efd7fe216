#!/usr/bin/env bash
# test/stress/example_webhook.sh: examples/webhook-inbox end to end, over real HTTP.
#
# Starts the receiver, idem-relay --in http serving /webhooks/{source} for
# shop, billing and crm (as role webhook_receiver), and two workers
# (examples/webhook-inbox/worker.py, as role webhook_worker), then:
#   1. functional checks, the answers a webhook sender acts on: no
#      X-Delivery-Id, a body that is not JSON, an over-long id are 400, a
#      source the relay does not serve 404; a new delivery is 200
#      {"stored": true}, its redelivery 200 {"duplicate": true}, the id with
#      another body 409; with the receiver's capability revoked 503 (the
#      sender retries) and nothing stored, then 200 once it is back; the
#      message is applied once;
#   2. stress: 600 messages from 3 sources, 360 of them on 30 ordering keys
#      (accounts; 12 messages each, each sent after the previous one was
#      acknowledged), 240 without; every message delivered 1-3 times more,
#      at random later moments and concurrently (44 sender threads, paced
#      so that the sending lasts about 6 s).  The
#      workers' handler fails 5 % of the time (retried by the inbox); worker
#      1 is killed (-9) after 2 s and started again (its leases run out and
#      others take over), the relay is killed (-9) after 3.5 s and started
#      again on the same port 1 s later (senders retry what went
#      unanswered, as webhook senders do).
#      Checks: every delivery answered 200 in the end; at most one answer
#      per message said "stored" (and those that got none are no more than
#      the deliveries the relay kill cut off: stored, answer lost, the retry
#      a duplicate); each message stored once and applied exactly once (and
#      nothing more after the leases ran out); per ordering key, effects in
#      the order sent; balances equal the sums sent; nothing dead-lettered;
#      both workers took part.
# Exits non-zero on any failed check.  Connection from PGHOST/PGPORT/
# PGDATABASE/PGUSER (run by test/run-tests, part "stress", in an empty
# database).  Settings: IDEM_EXAMPLE_PORT (TCP port of the receiver on
# 127.0.0.1, IDEM_EXAMPLE_PORT+2 is used; default: a free one), IDEM_PYTHON
# (python3 with psycopg2; default /usr/bin/python3), IDEM_BINDIR (where
# idem-relay is; default: $PATH).
set -euo pipefail

cd "$(dirname "$0")/../.."
EX=examples/webhook-inbox
. test/stress/examples.bash
if [[ $PORT != 0 ]]; then
    PORT=$((PORT + 2))
else                    # the relay is restarted on the same port: choose one now
    PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
RELAY=${IDEM_BINDIR:+$IDEM_BINDIR/}idem-relay
command -v "$RELAY" >/dev/null || { echo "FAIL: no idem-relay ($RELAY)"; exit 1; }
LEASE='2 seconds'
URL=http://127.0.0.1:$PORT

psql -X -q -v ON_ERROR_STOP=1 -c 'SET client_min_messages = warning' -f "$EX/schema.sql"

# the receiver and the workers run as the roles schema.sql made, with the
# grants it shows and nothing else; the receiver as the README starts it
receiver() {
    PGUSER=webhook_receiver "$RELAY" --in http --url "$URL/webhooks/{source}" --source shop,billing,crm \
        --message-id header:X-Delivery-Id --ordering-key header:X-Ordering-Key \
        >>"$tmp/receiver.log" 2>&1 &
    RPID=$!
    pids+=("$RPID")
    for _ in $(seq 100); do
        curl -s -o /dev/null "$URL/" && return 0
        sleep 0.1
    done
    echo "FAIL: the receiver did not start"
    exit 1
}
receiver; relay=$RPID

# worker N: start worker wN in the background; sets WPID
worker() {
    PGUSER=webhook_worker "$PY" "$EX/worker.py" --name "w$1" --batch 10 --lease "$LEASE" --poll 0.1 --fail-rate 0.05 \
        >>"$tmp/worker$1.log" 2>&1 &
    WPID=$!
    pids+=("$WPID")
}
worker 1; w1=$WPID
worker 2

cat >"$tmp/check.py" <<'PY'
import collections, http.client, json, pickle, queue, random, sys, threading, time, urllib.error, urllib.request
import psycopg2
from stress_checks import check, exit_status, sql

phase, URL, STATE = sys.argv[1:4]

cut = collections.Counter()       # deliveries the relay kill cut off (no answer: sent again)

def deliver(source, delivery_id, body, ordering_key=None):
    """POST a webhook until it is answered, retrying 5xx and lost connections for
    up to 20 s, as a webhook sender does; (status, json body)."""
    headers = {"Content-Type": "application/json"}
    if delivery_id is not None:
        headers["X-Delivery-Id"] = delivery_id
    if ordering_key:
        headers["X-Ordering-Key"] = ordering_key
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    deadline = time.monotonic() + 20
    while True:
        req = urllib.request.Request(f"{URL}/webhooks/{source}", data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code < 500 or time.monotonic() > deadline:
                return e.code, json.loads(e.read())
        except (OSError, http.client.HTTPException) as e:
            cut[delivery_id] += 1
            if time.monotonic() > deadline:
                return None, {"error": repr(e)}
        time.sleep(0.2)

def wait_applied(n, where="true", timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (count,), = sql(f"SELECT count(*) FROM ledger WHERE {where}")
        if count >= n:
            return count
        time.sleep(0.25)
    return count

def functional():
    body = {"account": "func-1", "amount": 5}
    st = [deliver("shop", None, body)[0], deliver("shop", "f-1", b"{oops")[0],
          deliver("shop", "x" * 2001, body)[0]]
    check(st == [400, 400, 400], f"no X-Delivery-Id, a body that is not JSON, a 2001-byte id are 400: {st}")
    st = deliver("nowhere", "f-1", body)[0]
    check(st == 404, f"a source the relay does not serve is 404: {st}")
    first, again = deliver("shop", "f-1", body), deliver("shop", "f-1", body)
    check(first == (200, {"stored": True}) and again[0] == 200 and again[1].get("duplicate") is True,
          f"a new delivery is 200 {first[1]}, its redelivery 200 {again[1]}")
    st, b = deliver("shop", "f-1", {"account": "func-1", "amount": 6})
    check(st == 409, f"the same delivery id with another body is 409: {b}")
    # the database refuses (the receiver's capability revoked): 503, the sender retries
    sql("SELECT idem_revoke('webhook_receiver')")
    req = urllib.request.Request(f"{URL}/webhooks/shop", data=json.dumps(body).encode(), method="POST",
                                 headers={"X-Delivery-Id": "f-2"})
    try:
        urllib.request.urlopen(req, timeout=10)
        st = 200
    except urllib.error.HTTPError as e:
        st = e.code
    (n,), = sql("SELECT count(*) FROM idempotency.inbox_messages WHERE message_id = 'f-2'")
    sql("SELECT idem_grant('webhook_receiver', 'handler', sources => ARRAY['shop', 'billing', 'crm'])")
    check(st == 503 and n == 0, f"with the receiver's capability revoked: {st}, {n} stored")
    st, b = deliver("shop", "f-2", body)
    check(st == 200 and b.get("stored") is True, f"the capability back, the retry: {st} {b}")
    n = wait_applied(2, "message_id IN ('f-1', 'f-2')", 30)
    time.sleep(1)
    (n,), = sql("SELECT count(*) FROM ledger WHERE message_id IN ('f-1', 'f-2')")
    check(n == 2, f"the 2 messages were applied {n} times (by a worker)")

def send():
    rnd = random.Random(7)
    sources = ["shop", "billing", "crm"]
    sent = {}                      # (source, message id) -> payload
    ordered = collections.defaultdict(list)
    for a in range(30):
        src, acct = sources[a % 3], f"acct-{a:02d}"
        for n in range(1, 13):
            mid = f"{acct}-n{n:02d}"
            sent[(src, mid)] = {"account": acct, "amount": rnd.randint(1, 1000), "n": n}
            ordered[(src, acct)].append(mid)
    loose = []
    for i in range(240):
        src, mid = rnd.choice(sources), f"loose-{i:03d}"
        sent[(src, mid)] = {"account": f"loose-{i % 17}", "amount": rnd.randint(1, 1000)}
        loose.append((src, mid))
    answers = collections.defaultdict(list)    # message -> [duplicate flag per delivery]
    bad, lock = [], threading.Lock()
    redeliveries = queue.PriorityQueue()
    t0 = time.monotonic()

    def one(src, mid, okey=None):
        if len(bad) > 10:                       # broken: stop sending, fail below
            return
        st, b = deliver(src, mid, sent[(src, mid)], okey)
        with lock:
            if st == 200:
                answers[(src, mid)].append(b.get("duplicate", False))
            else:
                bad.append((src, mid, st, b))

    def first_delivery(src, mid, okey=None):
        one(src, mid, okey)
        for _ in range(rnd.randint(1, 3)):     # the sender's at-least-once: the same again later
            redeliveries.put((time.monotonic() + rnd.uniform(0, 4), rnd.random(), src, mid, okey))

    # paced, so that the sending spans the kills (about 6 s)
    def account(src, acct, mids):
        for mid in mids:                        # the next only once the previous is acknowledged
            first_delivery(src, mid, acct)
            time.sleep(random.uniform(0.3, 0.7))

    loose_q = queue.Queue()
    for m in loose:
        loose_q.put(m)
    def loose_sender():
        while True:
            try:
                src, mid = loose_q.get_nowait()
            except queue.Empty:
                return
            first_delivery(src, mid)
            time.sleep(random.uniform(0.05, 0.25))

    senders = [threading.Thread(target=account, args=(s, a, m)) for (s, a), m in ordered.items()]
    senders += [threading.Thread(target=loose_sender) for _ in range(6)]
    [t.start() for t in senders]
    done = threading.Event()
    def redeliverer():
        while True:
            try:
                due, _, src, mid, okey = redeliveries.get(timeout=0.2)
            except queue.Empty:
                if done.is_set():
                    return
                continue
            time.sleep(max(0, due - time.monotonic()))
            one(src, mid, okey)
    redeliverers = [threading.Thread(target=redeliverer) for _ in range(8)]
    [t.start() for t in redeliverers]
    [t.join() for t in senders]
    done.set()
    [t.join() for t in redeliverers]
    deliveries = sum(len(v) for v in answers.values()) + len(bad)
    print(f"sent {len(sent)} messages in {deliveries} deliveries in {time.monotonic() - t0:.1f} s", flush=True)
    check(not bad, f"every delivery answered 200 ({len(bad)} not: {bad[:3]})")
    fresh = collections.Counter(v.count(False) for v in answers.values())
    unanswered = fresh.get(0, 0)          # stored, the answer lost to the relay kill
    check(len(answers) == len(sent) and set(fresh) <= {0, 1} and unanswered <= sum(cut.values()),
          f"each of {len(answers)} messages answered 'stored' at most once ({unanswered} never: their answer "
          f"was lost to the relay kill; {sum(cut.values())} deliveries got no answer and were sent again), "
          f"the other {deliveries - len(sent) + unanswered} deliveries 'duplicate'")
    check(sum(cut.values()) > 0, f"the relay kill left {sum(cut.values())} deliveries unanswered "
          f"(cut off or refused while it was down; sent again)")
    with open(STATE, "wb") as f:
        pickle.dump((sent, dict(ordered)), f)

def verify():
    with open(STATE, "rb") as f:
        sent, ordered = pickle.load(f)
    t0 = time.monotonic()
    n = wait_applied(len(sent), "account <> 'func-1'")
    print(f"the workers applied {n} messages, the last {time.monotonic() - t0:.1f} s after the senders were done",
          flush=True)
    time.sleep(4)                   # twice the lease: a lost lease would have let a duplicate through by now
    rows = sql("SELECT source, message_id, count(*) FROM idempotency.inbox_messages "
               "WHERE message_id NOT IN ('f-1', 'f-2') GROUP BY 1, 2")
    check(len(rows) == len(sent) and all(c == 1 and (s, m) in sent for s, m, c in rows),
          f"{len(rows)} of {len(sent)} messages in the inbox, each once, under the source its path named")
    rows = sql("SELECT source, message_id, count(*) FROM ledger WHERE account <> 'func-1' GROUP BY 1, 2")
    once = sum(1 for s, m, c in rows if c == 1 and (s, m) in sent)
    check(len(rows) == len(sent) and once == len(sent),
          f"{once} of {len(sent)} messages applied exactly once ({sum(c for _, _, c in rows)} ledger entries, "
          f"none after {2}x the lease)")
    inorder = 0
    for (src, acct), mids in ordered.items():
        got = [m for m, in sql("SELECT message_id FROM ledger WHERE source = %s AND account = %s ORDER BY seq",
                               src, acct)]
        inorder += got == mids
    check(inorder == len(ordered), f"{inorder} of {len(ordered)} ordering keys applied in the order sent")
    sums = collections.Counter()
    for p in sent.values():
        sums[p["account"]] += p["amount"]
    got = dict(sql("SELECT account, balance FROM balances WHERE account <> 'func-1'"))
    check(got == dict(sums), f"{len(got)} balances equal the sums sent")
    (dead,), = sql("SELECT count(*) FROM idempotency.inbox_dead")
    check(dead == 0, f"{dead} messages dead-lettered")
    by = dict(sql("SELECT worker, count(*) FROM ledger WHERE account <> 'func-1' GROUP BY worker"))
    check(len(by) >= 2, f"messages applied by worker: {dict(sorted(by.items()))}")
    try:                            # information only: the inbox's own table
        (again, most), = sql("SELECT count(*) FILTER (WHERE attempts > 1), max(attempts) FROM idempotency.inbox_messages")
        print(f"{again} messages were handed out more than once (failures, held back, lost leases), "
              f"at most {most} times", flush=True)
    except psycopg2.Error:
        pass

{"functional": functional, "send": send, "verify": verify}[phase]()
sys.exit(exit_status())
PY

failed=0
"$PY" "$tmp/check.py" functional "$URL" "$tmp/state" || failed=1

echo "stress: 2 workers (batch 10, lease $LEASE, handler failing 5 % of runs); worker 1 killed after 2 s, the relay after 3.5 s"
"$PY" "$tmp/check.py" send "$URL" "$tmp/state" &
sender=$!
pids+=("$sender")
sleep 2
kill -KILL "$w1"
wait "$w1" 2>/dev/null || true
echo "killed worker 1 (kill -9); starting it again"
worker 1
sleep 1.5
kill -KILL "$relay"
wait "$relay" 2>/dev/null || true
echo "killed the relay (kill -9); starting it again on $URL in 1 s"
sleep 1
receiver; relay=$RPID
wait "$sender" || failed=1
"$PY" "$tmp/check.py" verify "$URL" "$tmp/state" || failed=1
echo "handler failures retried: $(cat "$tmp"/worker*.log | grep -c 'failed:' || true); leases lost: $(cat "$tmp"/worker*.log | grep -c 'lease lost' || true)"

if [[ $failed -ne 0 ]]; then
    echo "FAILED"
    exit 1
fi
echo "all checks passed"
