#!/usr/bin/env bash
# test/stress/request_snapshot_stress.sh: request idempotency (SPEC 5) under
# every isolation level at once, across partition boundaries.
#
# Partitions of 2 seconds (retention 2 minutes, longer than the run), so the
# run crosses several boundaries; a maintenance thread runs idem_maintain()
# every 2 s.  Clients send every key 3-4 times, shuffled so that copies
# overlap; each send picks READ COMMITTED, REPEATABLE READ or SERIALIZABLE
# and one of two handlers:
#   one    one transaction: take the snapshot, pause, begin; if 'started',
#          fence, make the effect, complete -- the review's case: a snapshot
#          older than another client's whole request;
#   steps  begin; then fence + effect + checkpoint; then fence + complete,
#          each its own transaction; in 10 % the client "crashes" after the
#          effect (leaves the request started), so a later send takes over
#          after the lease (0.3 s) and must resume after the effect.
# A begin waits for a live lease in half of the sends.  IK002, IK003, 40001
# and 40P01 are retried; anything else is a failure.
# Checks: every key completed, in one row; its effect made exactly once; the
# stored response names the attempt that made the effect; every replay
# equals the stored response; no unexpected SQLSTATE (23505, XX000, ...).
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/run-tests, part
# "stress", in an empty database).  Settings: IDEM_STRESS_KEYS (1500),
# IDEM_STRESS_CLIENTS (18), IDEM_PYTHON (python3 with psycopg2).  (All
# clients share one clock: a claim made by a session whose clock runs ahead
# goes into a partition the others do not probe yet.)
set -euo pipefail

cd "$(dirname "$0")/../.."
. test/stress/examples.bash

psql -X -q -v ON_ERROR_STOP=1 <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
SELECT idem_configure(retention => '2 minutes', partition_interval => '2 seconds', premake => 30);
SELECT count(*) FROM idem_maintain();
CREATE TABLE stress_effects (key text NOT NULL, attempt int NOT NULL, made_at timestamptz DEFAULT clock_timestamp());
SQL

cat >"$tmp/stress.py" <<'PY'
import collections, json, os, queue, random, sys, threading, time
import psycopg2, psycopg2.extras
from stress_checks import check, copies_queue, drain, exit_status

psycopg2.extras.register_default_jsonb(globally=True, loads=lambda s: s)
NKEYS = int(os.environ.get("IDEM_STRESS_KEYS", "1500"))
NCLIENTS = int(os.environ.get("IDEM_STRESS_CLIENTS", "18"))
LEVELS = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"]
RETRY = {"IK002", "IK003", "40001", "40P01"}

stats, lock = collections.Counter(), threading.Lock()
replays = collections.defaultdict(set)      # key -> responses handed back as 'completed'
unexpected = []
def count(what, n=1):
    with lock:
        stats[what] += n

class Retry(Exception):
    pass

# connections run in autocommit: each handler step is an explicit BEGIN
# ISOLATION LEVEL ... COMMIT (psycopg2's implicit BEGIN would ignore the level)
def tx(cur, level):
    cur.execute(f"BEGIN ISOLATION LEVEL {level}")

def commit(cur):
    cur.execute("COMMIT")

def rollback(conn):
    if not conn.closed:
        conn.cursor().execute("ROLLBACK")

def begin(cur, key, wait):
    cur.execute("SELECT status, attempt, recovery_point, state, response FROM idem_request_begin("
                "%s, 'stress', jsonb_build_object('key', %s::text), lease => '0.3 seconds', wait => %s)",
                (key, key, wait))
    return cur.fetchone()

def effect_and_complete(cur, key, attempt, rp, state):
    """In the caller's transaction: fence; the effect unless resumed after it; complete."""
    cur.execute("SELECT idem_request_fence(%s, 'stress', %s)", (key, attempt))
    if rp == "effect_done":
        made = json.loads(state)["effect_attempt"]
    else:
        cur.execute("INSERT INTO stress_effects (key, attempt) VALUES (%s, %s)", (key, attempt))
        made = attempt
    cur.execute("SELECT idem_request_complete(%s, 'stress', jsonb_build_object('effect_attempt', %s::int),"
                " %s, 201)", (key, made, attempt))

def one_transaction(conn, key, level, wait, rnd):
    cur = conn.cursor()
    tx(cur, level)
    cur.execute("SELECT count(*) FROM stress_effects WHERE key = %s", (key,))   # the snapshot
    (seen,), = cur.fetchall()
    time.sleep(rnd.random() * 0.03)
    status, attempt, rp, state, response = begin(cur, key, wait)
    if status == "completed":
        commit(cur)
        if seen == 0 and level != "READ COMMITTED":
            count("replays of effects the snapshot could not see")
        return response
    effect_and_complete(cur, key, attempt, rp, state)
    commit(cur)
    if rp != "effect_done":
        count("effects (one transaction)")
    return None

def in_steps(conn, key, level, wait, rnd):
    cur = conn.cursor()
    tx(cur, level)
    status, attempt, rp, state, response = begin(cur, key, wait)
    commit(cur)
    if status == "completed":
        return response
    if rp != "effect_done":
        tx(cur, level)
        cur.execute("SELECT idem_request_fence(%s, 'stress', %s)", (key, attempt))
        cur.execute("INSERT INTO stress_effects (key, attempt) VALUES (%s, %s)", (key, attempt))
        cur.execute("SELECT idem_request_checkpoint(%s, 'stress', %s, 'effect_done',"
                    " jsonb_build_object('effect_attempt', %s::int))", (key, attempt, attempt))
        commit(cur)
        count("effects (in steps)")
        if rnd.random() < 0.1:
            count("crashes after the effect")
            raise Retry()
        rp, state = "effect_done", json.dumps({"effect_attempt": attempt})
    else:
        count("resumed after the effect")
    time.sleep(rnd.random() * 0.02)
    tx(cur, level)
    effect_and_complete(cur, key, attempt, rp, state)
    commit(cur)
    return None

def client(n, tasks):
    rnd = random.Random(n)
    conn = psycopg2.connect("")
    conn.autocommit = True
    for key in drain(tasks):
        deadline = time.monotonic() + 60
        while True:
            level = rnd.choice(LEVELS)
            wait = rnd.choice(["0", "0.5 seconds"])
            handler = rnd.choice([one_transaction, in_steps])
            count(f"sends at {level}")
            try:
                response = handler(conn, key, level, wait, rnd)
                if response is not None:
                    with lock:
                        replays[key].add(response)
                break
            except Retry:
                pass
            except psycopg2.Error as e:
                rollback(conn)
                if e.pgcode not in RETRY:
                    with lock:
                        unexpected.append((key, e.pgcode, str(e).splitlines()[0]))
                    break
                count(f"{e.pgcode} at {level}")
            if time.monotonic() > deadline:
                count("gave up")
                break
            time.sleep(rnd.uniform(0.01, 0.1))
    conn.close()

def maintenance(stop):
    conn = psycopg2.connect("")
    conn.autocommit = True
    while not stop.is_set():
        try:
            conn.cursor().execute("SELECT count(*) FROM idem_maintain()")
            count("maintenance rounds")
        except psycopg2.Error as e:
            with lock:
                unexpected.append(("maintenance", e.pgcode, str(e).splitlines()[0]))
        stop.wait(2)
    conn.close()

rnd = random.Random(7)
keys = [f"k-{i:04d}" for i in range(NKEYS)]
tasks, ntasks = copies_queue(keys, 20, rnd)
stop = threading.Event()
mt = threading.Thread(target=maintenance, args=(stop,))
mt.start()
t0 = time.monotonic()
threads = [threading.Thread(target=client, args=(n, tasks)) for n in range(NCLIENTS)]
[t.start() for t in threads]
[t.join() for t in threads]
stop.set()
mt.join()
print("stress: %d keys, %d sends by %d clients in %.1f s: %s" % (
    NKEYS, ntasks, NCLIENTS, time.monotonic() - t0,
    ", ".join(f"{n} {w}" for w, n in sorted(stats.items()))), flush=True)

check(not unexpected and stats["gave up"] == 0,
      f"no unexpected error and no send gave up: {unexpected[:10]}")
conn = psycopg2.connect("")
conn.autocommit = True
cur = conn.cursor()
# the crashed requests: finish them (a send after the lease resumes them)
cur.execute("SELECT key FROM idempotency.requests WHERE scope = 'stress' AND status = 'started'")
left = [k for (k,) in cur.fetchall()]
time.sleep(0.5)
for k in left:
    in_steps(conn, k, "READ COMMITTED", "0", random.Random(1))
print(f"{len(left)} requests left started by a crash were finished by one more send")
cur.execute("""SELECT r.key, r.status, r.response->>'effect_attempt', n.rows, e.effects, e.attempts
                 FROM idempotency.requests r
                 JOIN (SELECT key, count(*) AS rows FROM idempotency.requests WHERE scope = 'stress' GROUP BY 1) n USING (key)
                 LEFT JOIN (SELECT key, count(*) AS effects, min(attempt) AS attempts FROM stress_effects GROUP BY 1) e USING (key)
                WHERE r.scope = 'stress'""")
rows = {k: (s, ea, n, e, a) for k, s, ea, n, e, a in cur.fetchall()}
check(sorted(rows) == keys and all(v[2] == 1 for v in rows.values()),
      f"{len(rows)} keys have a request, each in one row")
check(all(v[0] == "completed" for v in rows.values()),
      f"{sum(v[0] == 'completed' for v in rows.values())} of {NKEYS} requests completed")
doubled = [k for k, v in rows.items() if v[3] != 1]
check(not doubled, f"every key's effect made exactly once (not: {doubled[:10]})")
wrong = [k for k, v in rows.items() if v[1] is None or int(v[1]) != v[4]]
check(not wrong, f"every stored response names the attempt that made the effect (not: {wrong[:10]})")
cur.execute("SELECT key, response::text FROM idempotency.requests WHERE scope = 'stress'")
stored = dict(cur.fetchall())
differ = [k for k, rs in replays.items() if any(json.loads(r) != json.loads(stored[k]) for r in rs)]
check(not differ, f"{sum(len(v) for v in replays.values())} replays, all equal to the stored response "
      f"(not: {differ[:10]})")
cur.execute("SELECT count(DISTINCT bucket) FROM idempotency.requests WHERE scope = 'stress'")
(parts,), = cur.fetchall()
print(f"the requests went into {parts} partitions")
check(stats["replays of effects the snapshot could not see"] > 0
      and stats["40001 at REPEATABLE READ"] + stats["40001 at SERIALIZABLE"] > 0,
      "snapshots older than another client's request were met: replayed, or 40001 and retried")
sys.exit(exit_status())
PY

"$PY" "$tmp/stress.py"
