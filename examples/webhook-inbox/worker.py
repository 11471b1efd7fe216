#!/usr/bin/env python3
"""Process what idem-relay --in http stored (README.md): claim a batch from
the inbox, apply each message's effect and mark it done in the same
transaction.

Run as many workers as you like: a claim leases its messages, and messages
that share an ordering key are handed out one run at a time, in the order
they were received.  A message whose handler fails goes back with
idem_inbox_fail (retried later with backoff, dead-lettered in
idempotency.inbox_dead after idempotency.inbox_max_attempts).
Database: libpq environment (PGHOST, PGPORT, PGDATABASE, PGUSER) or --dsn.
"""
import argparse
import random
import time

import psycopg2


class LeaseLost(Exception):
    pass


def apply(cur, source, message_id, payload, worker):
    """The effect: a ledger entry and the account's new balance."""
    account, amount = payload["account"], int(payload["amount"])
    cur.execute("INSERT INTO ledger (source, message_id, account, amount, worker) VALUES (%s, %s, %s, %s, %s)",
                (source, message_id, account, amount, worker))
    cur.execute("""INSERT INTO balances AS b (account, balance) VALUES (%s, %s)
                   ON CONFLICT (account) DO UPDATE SET balance = b.balance + excluded.balance""",
                (account, amount))
    if random.random() < args.fail_rate:          # a flaky handler, to see retries at work
        raise RuntimeError("simulated handler failure")


def run_once(conn):
    """Claim one batch and process it; return how many messages were claimed."""
    with conn, conn.cursor() as cur:
        cur.execute("SELECT id, source, message_id, payload, headers, lease_token FROM idem_inbox_claim(%s, %s, %s)",
                    (args.batch, args.lease, args.source or None))
        batch = cur.fetchall()
    held_back = set()       # ordering keys with a failure in this batch: their later messages wait
    for id, source, message_id, payload, headers, token in batch:
        okey = (source, headers.get("ordering_key"))
        if okey[1] is not None and okey in held_back:
            # not applied before the failed one: back to the inbox, handed out again after it
            with conn, conn.cursor() as cur:
                cur.execute("SELECT idem_inbox_fail(%s, %s, NULL, %s)",
                            (id, f"held back behind a failed message of ordering key {okey[1]}", token))
            continue
        try:
            with conn, conn.cursor() as cur:          # one transaction: effect + done
                apply(cur, source, message_id, payload, args.name)
                cur.execute("SELECT idem_inbox_done(ARRAY[%s]::uuid[], %s)", (id, token))
                if cur.fetchone()[0] != 1:            # our lease ended and someone else may have it:
                    raise LeaseLost(message_id)       # roll the effect back
        except LeaseLost:
            print(f"{args.name}: lease lost on {source}/{message_id}, effect rolled back", flush=True)
            held_back.add(okey)
        except Exception as e:                        # noqa: BLE001 - any handler error
            with conn, conn.cursor() as cur:
                cur.execute("SELECT idem_inbox_fail(%s, %s, NULL, %s)", (id, repr(e), token))
            print(f"{args.name}: {source}/{message_id} failed: {e!r}", flush=True)
            held_back.add(okey)
    return len(batch)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dsn", default="", help="libpq connection string (default: PG* environment)")
    p.add_argument("--name", default="worker", help="recorded with each ledger entry")
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--lease", default="30 seconds")
    p.add_argument("--source", action="append", help="only these sources (repeat; default: all)")
    p.add_argument("--poll", type=float, default=0.2, help="seconds to sleep when the inbox is empty")
    p.add_argument("--fail-rate", type=float, default=0.0, help="fraction of handler runs that fail")
    args = p.parse_args()
    conn = psycopg2.connect(args.dsn)
    print(f"{args.name}: processing the inbox", flush=True)
    while True:
        if run_once(conn) == 0:
            time.sleep(args.poll)
