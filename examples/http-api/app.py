#!/usr/bin/env python3
"""A payments HTTP API that honours Idempotency-Key, on the idempotency extension.

POST /payments  {customer, amount, currency}, header Idempotency-Key (required)
  201 payment made (with Location), 402 card declined: both stored, headers
  included, and replayed byte for byte to every later request with the same
  key (header Idempotent-Replayed: true);
  400 bad input, 409 the key is being worked on (Retry-After), 422 the key was
  used with another body, 503 the provider failed (Retry-After; nothing stored).

Each request: idem_request_begin -> (provider charge, keyed by our key ->
idem_request_checkpoint 'charged') -> one transaction: idem_request_fence +
INSERT INTO payments + idem_request_complete.  Each step is its own short
transaction; no database connection is held during the provider call.
Database: libpq environment (PGHOST, PGPORT, PGDATABASE, PGUSER) or --dsn.
"""
import argparse
import contextlib
import json
import math
import queue
import re
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg2

SCOPE = "payments"
args = None


class Pool:
    """At most SIZE connections, handed out one per step, never during the provider call."""

    def __init__(self, dsn, size):
        self.dsn, self.free, self.slots = dsn, queue.LifoQueue(), threading.BoundedSemaphore(size)

    @contextlib.contextmanager
    def transaction(self):
        """A cursor in one transaction: committed at the end of the block, rolled back on error."""
        with self.slots:
            try:
                conn = self.free.get_nowait()
            except queue.Empty:
                conn = psycopg2.connect(self.dsn)
            try:
                with conn, conn.cursor() as cur:
                    yield cur
            finally:
                if not conn.closed:     # a broken connection is dropped
                    self.free.put(conn)


class HTTPError(Exception):
    def __init__(self, status, error, retry_after=None):
        super().__init__(error)
        self.status, self.body, self.retry_after = status, {"error": error}, retry_after


def db_error_to_http(e):
    """SQLSTATE -> HTTP, as the error table of doc/reference.md says.  (IK002 does not come:
    begin is called with on_conflict => 'return' and answers in_progress instead.)"""
    code = e.pgcode
    if code in ("22004", "22023", "22001"):
        return HTTPError(400, e.diag.message_primary)
    if code == "IK001":
        return HTTPError(422, "idempotency key reused with a different request")
    if code == "IK003":                 # our lease was taken over: the other holder finishes
        return HTTPError(409, "request in progress", 1)
    return None


def stored_headers(headers, replayed):
    """The headers to send with a stored answer: its own, and the replay marker."""
    out = dict(headers or {})
    if replayed:
        out["Idempotent-Replayed"] = "true"
    return out


def call_provider(key, req):
    """Charge at the provider with OUR key as ITS Idempotency-Key: a retry never charges twice.
    Returns (http status, body), or None on a timeout or a provider error."""
    http_req = urllib.request.Request(
        args.provider + "/charges", data=json.dumps(req).encode(), method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": key})
    try:
        with urllib.request.urlopen(http_req, timeout=args.provider_timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code == 402:
            return 402, json.loads(e.read())
        return None
    except OSError:                     # timeout, connection refused or reset
        return None


def finish(key, attempt, req, status, charge):
    """Record the outcome and store the response, in one transaction; return what was stored
    (status, body text, headers): the first answer, the same bytes as every replay."""
    with pool.transaction() as cur:
        # raises IK003 if another attempt took over, and keeps it from completing until we commit
        cur.execute("SELECT idem_request_fence(%s, %s, %s)", (key, SCOPE, attempt))
        cur.execute("""
            INSERT INTO payments (key, customer, amount, currency, status, charge_id, request)
            VALUES (%s, %s, %s, %s, %s, %s, %s)
            RETURNING id, CASE WHEN status = 'succeeded'
                THEN jsonb_build_object('id', 'pay_' || id, 'status', status, 'charge_id', charge_id,
                                        'customer', customer, 'amount', amount, 'currency', currency)
                ELSE jsonb_build_object('id', 'pay_' || id, 'status', status,
                                        'error', 'card_declined', 'decline_code', %s) END::text""",
                    (key, req["customer"], req["amount"], req["currency"],
                     "succeeded" if status == 201 else "declined", charge.get("id"),
                     json.dumps(req), charge.get("decline_code")))
        payment_id, body = cur.fetchone()
        headers = {"Location": f"/payments/pay_{payment_id}"} if status == 201 else None
        # stored as jsonb; response_body is its canonical text, as every replay will return it
        cur.execute("""SELECT response_status, response_body, response_headers
                       FROM idem_request_complete(%s, %s, %s, %s, %s, response_headers => %s)""",
                    (key, SCOPE, body, attempt, status, json.dumps(headers) if headers else None))
        response_status, response_body, response_headers = cur.fetchone()
    return response_status, response_body, stored_headers(response_headers, False)


def handle_payment(key, req):
    """Return (status, body text, headers)."""
    with pool.transaction() as cur:
        cur.execute("""SELECT status, attempt, recovery_point, state, retry_after,
                              replayed, response_status, response_body, response_headers
                       FROM idem_request_begin(%s, %s, %s, lease => %s, wait => %s,
                                               on_conflict => 'return')""",
                    (key, SCOPE, json.dumps(req), args.lease, args.wait))
        (status, attempt, recovery_point, state, retry_after,
         replayed, response_status, response_body, response_headers) = cur.fetchone()
    if status == "in_progress":                   # another request holds the key: its lease left
        raise HTTPError(409, "request in progress", max(1, math.ceil(retry_after.total_seconds())))
    if status == "completed":                     # the stored answer, as first sent
        return response_status, response_body, stored_headers(response_headers, replayed)
    try:
        if recovery_point == "charged":           # an earlier attempt charged, then stopped
            charge_status, charge = 201, state
        else:
            result = call_provider(key, req)
            if result is None:                    # not stored: the retry starts afresh
                with pool.transaction() as cur:
                    cur.execute("SELECT idem_request_abandon(%s, %s, %s)", (key, SCOPE, attempt))
                raise HTTPError(503, "payment provider unavailable", 1)
            charge_status, charge = result
            if charge_status == 201:
                with pool.transaction() as cur:
                    cur.execute("SELECT idem_request_checkpoint(%s, %s, %s, 'charged', %s)",
                                (key, SCOPE, attempt, json.dumps(charge)))
        return finish(key, attempt, req, charge_status, charge)
    except HTTPError:
        raise
    except Exception as e:
        if getattr(e, "pgcode", None) != "IK003":  # anything unforeseen: forget the key, so a
            with contextlib.suppress(psycopg2.Error):   # retry starts again (the provider dedups)
                with pool.transaction() as cur:
                    cur.execute("SELECT idem_request_abandon(%s, %s, %s)", (key, SCOPE, attempt))
        raise


def valid(req):
    return (isinstance(req, dict) and isinstance(req.get("customer"), str) and req["customer"]
            and type(req.get("amount")) is int and req["amount"] > 0
            and isinstance(req.get("currency"), str) and re.fullmatch(r"[A-Z]{3}", req["currency"]))


class Handler(BaseHTTPRequestHandler):
    def send(self, status, body, headers=None):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                for one in (v if isinstance(v, list) else [v]):   # an array: one line each
                    self.send_header(k, str(one))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass                                  # the client timed out; it will retry

    def do_POST(self):
        if self.path != "/payments":
            return self.send(404, {"error": "not found"})
        try:
            key = self.headers.get("Idempotency-Key")
            if not key:
                raise HTTPError(400, "Idempotency-Key header required")
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            except ValueError:
                raise HTTPError(400, "body is not JSON")
            if not valid(req):
                raise HTTPError(400, "body needs customer, a positive integer amount and a currency code")
            try:
                self.send(*handle_payment(key, req))
            except psycopg2.Error as e:
                if e.pgcode == "IK003":
                    self.log_error("lease lost: %s", e.diag.message_primary)
                raise db_error_to_http(e) or e
        except HTTPError as e:
            self.send(e.status, e.body, {"Retry-After": e.retry_after} if e.retry_after else None)
        except Exception as e:                    # noqa: BLE001 - answer, and log
            self.log_error("internal error: %r", e)
            self.send(500, {"error": "internal error"})

    def log_request(self, code="-", size="-"):     # errors are logged always, requests with --verbose
        if args.verbose:
            super().log_request(code, size)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dsn", default="", help="libpq connection string (default: PG* environment)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--provider", default="http://127.0.0.1:8081", help="payment provider base URL")
    p.add_argument("--provider-timeout", type=float, default=0.7, help="seconds")
    p.add_argument("--lease", default="5 seconds")
    p.add_argument("--wait", default="2 seconds", help="how long a duplicate waits for the holder")
    p.add_argument("--pool", type=int, default=20, help="database connections")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    pool = Pool(args.dsn, args.pool)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"payments API listening on http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()
