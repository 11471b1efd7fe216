#!/usr/bin/env python3
# A webhook receiver for TAP 091_relay_http: listens on 127.0.0.1:PORT and
# appends each accepted POST body, as one line, to FILE (flushed before the
# answer).  Answers 400 to events of aggregate type "poison", 503 to every
# 13th request (a transient failure: not recorded), 400 if the
# Idempotency-Key header is not the event's id, else 200; events of
# aggregate id "slow" take 0.8 s each (a slow receiver).
# Usage: webhook.py PORT FILE
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

port, path = int(sys.argv[1]), sys.argv[2]
out = open(path, "a")
count = 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 65536  # the answer in one write (no Nagle wait on the body)

    def answer(self, code, text):
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        global count
        count += 1
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        event = json.loads(body)
        if event.get("aggregate_type") == "poison":
            return self.answer(400, "poison refused")
        if self.headers.get("Idempotency-Key") != event.get("id"):
            return self.answer(400, "Idempotency-Key is not the event id")
        if event.get("aggregate_id") == "slow":
            time.sleep(0.8)
        elif count % 13 == 0:
            return self.answer(503, "try later")
        out.write(json.dumps(event) + "\n")
        out.flush()
        self.answer(200, "ok")

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
