#!/usr/bin/env python3
"""A webhook receiver that stores each delivery in the inbox and answers at once.

POST /webhooks/<source>   JSON body, header X-Delivery-Id (required),
                          X-Ordering-Key (optional: messages sharing it are
                          processed one at a time, in the order received)
  200 {"duplicate": false}  stored, to be processed by worker.py
  200 {"duplicate": true}   already received: nothing more happens
  400 no X-Delivery-Id, body not JSON; 422 the delivery id came before with another body

The sender only needs to hear 200 once; redeliveries are harmless.
Database: libpq environment (PGHOST, PGPORT, PGDATABASE, PGUSER) or --dsn.
"""
import argparse
import json
import queue
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg2

args = None
idle = queue.LifoQueue()        # open connections not in use
slots = None                    # at most --pool connections in use


def receive(source, delivery_id, body, ordering_key):
    """idem_inbox_receive in its own transaction: True when new, False for a duplicate."""
    with slots:
        try:
            conn = idle.get_nowait()
        except queue.Empty:
            conn = psycopg2.connect(args.dsn)
        try:
            with conn, conn.cursor() as cur:
                cur.execute("SELECT idem_inbox_receive(%s, %s, %s, %s)",
                            (source, delivery_id, body,
                             json.dumps({"ordering_key": ordering_key} if ordering_key else {})))
                return cur.fetchone()[0]
        finally:
            if not conn.closed:             # a broken connection is dropped
                idle.put(conn)


class Handler(BaseHTTPRequestHandler):
    def send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        source = urllib.parse.unquote(self.path[len("/webhooks/"):])
        if not self.path.startswith("/webhooks/") or not source or "/" in source:
            return self.send(404, {"error": "not found"})
        delivery_id = self.headers.get("X-Delivery-Id")
        if not delivery_id:
            return self.send(400, {"error": "X-Delivery-Id header required"})
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            json.loads(body)
        except ValueError:
            return self.send(400, {"error": "body is not JSON"})
        try:
            new = receive(source, delivery_id, body.decode(), self.headers.get("X-Ordering-Key"))
        except psycopg2.Error as e:
            if e.pgcode == "IK001":
                return self.send(422, {"error": "delivery id reused with a different body"})
            if e.pgcode in ("22004", "22023", "22001"):
                return self.send(400, {"error": e.diag.message_primary})
            self.log_error("database error: %s", e)
            return self.send(500, {"error": "internal error"})    # the sender retries later
        self.send(200, {"duplicate": not new})

    def log_request(self, code="-", size="-"):     # errors are logged always, requests with --verbose
        if args.verbose:
            super().log_request(code, size)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dsn", default="", help="libpq connection string (default: PG* environment)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--pool", type=int, default=10, help="database connections")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    slots = threading.BoundedSemaphore(args.pool)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"webhook receiver listening on http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()
