"""test/stress/stress_checks.py: what the python parts of the stress tests
share (imported by the scripts they write to $tmp, with test/stress on
PYTHONPATH; not a test itself: test/run-tests runs only test/stress/*.sh).

check(cond, msg)   print "ok: MSG" or "FAIL: MSG", counting the failures
exit_status()      1 if a check failed, else 0 (for sys.exit)
copies_queue(keys, group, rnd)
                   a queue.Queue of 3 or 4 copies of every key, shuffled
                   within groups of GROUP keys (so the copies of a key land
                   close together), and how many tasks it holds
drain(tasks)       the tasks of a queue.Queue, one by one, until it is empty
sql(query, *params)
                   run one statement in a connection of its own (libpq's
                   environment, autocommit); its rows, or None if it
                   returns none
"""
import queue

failures = 0


def check(cond, msg):
    global failures
    print(("ok: " if cond else "FAIL: ") + msg, flush=True)
    failures += not cond


def exit_status():
    return 1 if failures else 0


def copies_queue(keys, group, rnd):
    tasks = queue.Queue()
    ntasks = 0
    for g in range(0, len(keys), group):
        chunk = [k for k in keys[g:g + group] for _ in range(rnd.choice([3, 4]))]
        rnd.shuffle(chunk)
        for k in chunk:
            tasks.put(k)
        ntasks += len(chunk)
    return tasks, ntasks


def drain(tasks):
    while True:
        try:
            yield tasks.get_nowait()
        except queue.Empty:
            return


def sql(query, *params):
    import psycopg2
    conn = psycopg2.connect("")
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else None
    finally:
        conn.close()
