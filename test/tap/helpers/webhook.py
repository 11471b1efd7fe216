#!/usr/bin/env python3
# A webhook receiver for TAP 091_relay_http and 105_relay_http_concurrent:
# listens on 127.0.0.1:PORT, one thread per connection, and appends each
# accepted POST body, as one line, to FILE (flushed before the answer).
# Answers 400 to events of aggregate type "poison", 503 to every 13th
# request (a transient failure: not recorded), 400 if the Idempotency-Key
# header is not the event's id, else 200; events of aggregate id "slow"
# take 0.8 s each (a slow receiver); an event of aggregate id "flaky" is
# answered 503 the first time it comes (not counted as a 13th).
# With LOG, every request also appends a line to LOG: {id, aggregate, status,
# t0, t1, inflight} (t0 when its handling began, t1 when its answer was
# decided, inflight the requests being handled at t0, itself included),
# and each takes DELAY seconds more (default 0), so that concurrent
# requests overlap visibly.
# Usage: webhook.py PORT FILE [LOG [DELAY]]
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, path = int(sys.argv[1]), sys.argv[2]
log = open(sys.argv[3], "a") if len(sys.argv) > 3 else None
delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
out = open(path, "a")
lock = threading.Lock()  # count, inflight, flaky_seen and both files
count = 0
inflight = 0
flaky_seen = set()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 65536  # the answer in one write (no Nagle wait on the body)

    def answer(self, code, text):
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def decide(self, event):
        global count
        if event.get("aggregate_type") == "poison":
            return 400, "poison refused"
        if self.headers.get("Idempotency-Key") != event.get("id"):
            return 400, "Idempotency-Key is not the event id"
        if event.get("aggregate_id") == "slow":
            time.sleep(0.8)
        elif event.get("aggregate_id") == "flaky":
            with lock:
                if event.get("id") not in flaky_seen:
                    flaky_seen.add(event.get("id"))
                    return 503, "flaky: try again"
        else:
            with lock:
                count += 1
                if count % 13 == 0:
                    return 503, "try later"
        return 200, "ok"

    def do_POST(self):
        global inflight
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        event = json.loads(body)
        with lock:
            inflight += 1
            t0, now_inflight = time.time(), inflight
        if delay:
            time.sleep(delay)
        code, text = self.decide(event)
        with lock:
            inflight -= 1
            if code == 200:
                out.write(json.dumps(event) + "\n")
                out.flush()
            if log:
                log.write(json.dumps({"id": event.get("id"),
                                      "aggregate": "%s:%s" % (event.get("aggregate_type"),
                                                              event.get("aggregate_id")),
                                      "status": code, "t0": t0, "t1": time.time(),
                                      "inflight": now_inflight}) + "\n")
                log.flush()
        self.answer(code, text)

    def log_message(self, *args):
        pass


ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
