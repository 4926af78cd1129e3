#!/usr/bin/env python3
"""A tiny stand-in for one vLLM replica, for running the plugin in a real Envoy (127.0.0.1 only).

    python3 backend.py NAME PORT [--waiting N] [--kv F] [--metrics-status CODE]

* POST /v1/chat/completions, /v1/completions: answers JSON naming this backend and echoing the
  `x-gateway-destination-endpoint` header it received (proves the plugin overwrote the
  client's value); with `"stream": true` answers text/event-stream in a few timed chunks.
* GET /v1/models: a one-model list.
* GET /metrics: vLLM-style Prometheus text; `num_requests_waiting` comes from --waiting, or
  from POST /control {"waiting": N, "metrics_status": CODE} at run time.
* GET /stats: how many scrapes and requests this backend served, and the scrape callers'
  `Host` headers.
"""
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = sys.argv[1]
PORT = int(sys.argv[2])
STATE = {"waiting": 0, "kv": 0.1, "metrics_status": 200, "scrapes": 0, "requests": 0,
         "scrape_hosts": [], "destinations": []}
LOCK = threading.Lock()

args = sys.argv[3:]
for flag, key, conv in (("--waiting", "waiting", int), ("--kv", "kv", float),
                        ("--metrics-status", "metrics_status", int)):
    if flag in args:
        STATE[key] = conv(args[args.index(flag) + 1])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # One segment per response and no Nagle: otherwise headers and body go out as two small
    # writes and a delayed ACK adds ~40 ms to some requests, drowning what we measure.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True

    def log_message(self, fmt, *a):  # keep the run's output readable
        pass

    def reply(self, code, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/metrics":
            with LOCK:
                STATE["scrapes"] += 1
                STATE["scrape_hosts"] = (STATE["scrape_hosts"] + [self.headers.get("host")])[-5:]
                status, waiting, kv = STATE["metrics_status"], STATE["waiting"], STATE["kv"]
            page = (
                "# HELP vllm:num_requests_waiting Requests waiting.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="m",engine="0"}} {waiting}\n'
                f'vllm:num_requests_running{{model_name="m",engine="0"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="m",engine="0"}} {kv}\n'
                'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 100\n'
                'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 40\n'
            )
            self.reply(status, page, "text/plain; version=0.0.4")
        elif path == "/stats":
            with LOCK:
                self.reply(200, json.dumps(STATE))
        elif path == "/v1/models":
            self.count_request()
            self.reply(200, json.dumps({"object": "list", "data": [{"id": "m"}], "backend": NAME}))
        else:
            self.count_request()
            self.reply(404, json.dumps({"backend": NAME, "error": "not found"}))

    def count_request(self):
        with LOCK:
            STATE["requests"] += 1
            STATE["destinations"] = (STATE["destinations"] +
                                     [self.headers.get("x-gateway-destination-endpoint")])[-5:]

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        path = self.path.split("?")[0]
        if path == "/control":
            with LOCK:
                STATE.update(json.loads(body or b"{}"))
            self.reply(200, "{}")
            return
        self.count_request()
        try:
            stream = bool(json.loads(body).get("stream"))
        except Exception:
            stream = False
        answer = {
            "backend": NAME,
            "destination_header": self.headers.get("x-gateway-destination-endpoint"),
            "bytes": len(body),
        }
        if not stream:
            self.reply(200, json.dumps(answer))
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(3):
            chunk = f"data: {json.dumps(dict(answer, chunk=i, t=time.time()))}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            time.sleep(0.3)
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
