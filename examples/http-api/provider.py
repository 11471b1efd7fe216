#!/usr/bin/env python3
"""A fake payment provider that, like real ones, deduplicates by Idempotency-Key.

POST /charges   {customer, amount, currency}, header Idempotency-Key (required)
                201 {"id": "ch_...", ...}  or  402 {"error": "card_declined", ...}
                The first request of a key decides its outcome; every later
                request with that key gets the same outcome and charges nothing.
GET  /charges   every outcome so far, one per key, with how many requests
                each key took: the test checks each key was charged once.

It is slow (50-400 ms) and unreliable on purpose: --timeout-rate of the
requests hang past the caller's timeout (charging before the hang, after it,
or not at all), --decline-rate of new keys are declined.  Customers named
cus_decline* are always declined, cus_timeout* always hang.
"""
import argparse
import json
import random
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

outcomes = {}            # idempotency key -> {"status": 201|402, "body": {...}, "requests": n}
lock = threading.Lock()
args = None


def charge(key, req):
    """Decide the outcome of KEY once; later calls return the same outcome."""
    with lock:
        out = outcomes.get(key)
        if out is None:
            if req["customer"].startswith("cus_decline") or random.random() < args.decline_rate:
                out = {"status": 402, "body": {"error": "card_declined", "decline_code": "insufficient_funds"}}
            else:
                out = {"status": 201, "body": {"id": "ch_" + uuid.uuid4().hex[:16], "status": "succeeded"}}
            out["body"].update(key=key, customer=req["customer"], amount=req["amount"],
                               currency=req["currency"])
            out["requests"] = 0
            outcomes[key] = out
        elif out["body"]["amount"] != req["amount"] or out["body"]["customer"] != req["customer"]:
            return {"status": 422, "body": {"error": "idempotency key reused with other parameters"}}
        out["requests"] += 1
        return out


class Handler(BaseHTTPRequestHandler):
    def reply(self, status, body):
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass                       # the caller gave up waiting: fine

    def do_GET(self):
        if self.path != "/charges":
            return self.reply(404, {"error": "not found"})
        with lock:
            self.reply(200, [dict(o["body"], requests=o["requests"], http_status=o["status"])
                             for o in outcomes.values()])

    def do_POST(self):
        if self.path != "/charges":
            return self.reply(404, {"error": "not found"})
        key = self.headers.get("Idempotency-Key")
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not key:
            return self.reply(400, {"error": "Idempotency-Key required"})
        time.sleep(random.uniform(0.05, 0.4))
        if req["customer"].startswith("cus_timeout") or random.random() < args.timeout_rate:
            when = random.choice(["before", "after", "never"])
            out = charge(key, req) if when == "before" else None
            time.sleep(args.hang)      # the caller has given up by now
            if when == "after":
                out = charge(key, req)
            return self.reply(504 if out is None else out["status"], out["body"] if out else {"error": "timeout"})
        out = charge(key, req)
        self.reply(out["status"], out["body"])

    def log_request(self, code="-", size="-"):     # errors are logged always, requests with --verbose
        if args.verbose:
            super().log_request(code, size)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--timeout-rate", type=float, default=0.0, help="fraction of requests that hang")
    p.add_argument("--decline-rate", type=float, default=0.0, help="fraction of new keys declined")
    p.add_argument("--hang", type=float, default=3.0, help="seconds a hanging request sleeps")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"provider listening on http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()
