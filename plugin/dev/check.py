#!/usr/bin/env python3
"""End-to-end checks of the plugin in a real Envoy (started by run.sh). 127.0.0.1 only.

Each check prints one line; the script exits non-zero if any fails.
"""
import http.client
import json
import socket
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ENVOY = ("127.0.0.1", 10000)
ADMIN = "http://127.0.0.1:19901"
BACKENDS = {"replica-1": 18001, "replica-2": 18002, "replica-3": 18003}
ADDRESS = {name: f"127.0.0.1:{port}" for name, port in BACKENDS.items()}
RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  -- ' + detail if detail else ''}", flush=True)


def request(method, path, body=None, headers=None, chunked=False):
    conn = http.client.HTTPConnection(*ENVOY, timeout=10)
    hdrs = {"content-type": "application/json"}
    hdrs.update(headers or {})
    if chunked:
        conn.putrequest(method, path)
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.putheader("transfer-encoding", "chunked")
        conn.endheaders()
        for i in range(0, len(body), 7):
            part = body[i:i + 7]
            conn.send(b"%x\r\n%s\r\n" % (len(part), part))
            time.sleep(0.01)
        conn.send(b"0\r\n\r\n")
    else:
        conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def chat(system, user, **extra):
    body = {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": user}]}
    body.update(extra)
    return json.dumps(body).encode()


def backend_stats(name):
    with urllib.request.urlopen(f"http://{ADDRESS[name]}/stats", timeout=5) as r:
        return json.loads(r.read())


def control(name, **kv):
    req = urllib.request.Request(f"http://{ADDRESS[name]}/control",
                                 data=json.dumps(kv).encode(), method="POST")
    urllib.request.urlopen(req, timeout=5).read()


def envoy_stats():
    with urllib.request.urlopen(f"{ADMIN}/stats?filter=prefixroute", timeout=5) as r:
        text = r.read().decode()
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def tenant(n):
    return f"You are the assistant of tenant {n}. " + " ".join(
        f"Rule {i}: answer politely about topic {n}-{i}." for i in range(60))


def main():
    # Wait for the first scrapes so that every endpoint is measured.
    time.sleep(1.5)

    # 1. Routing, header overwrite and response headers.
    status, h, data = request("POST", "/v1/chat/completions", chat(tenant(1), "hello"))
    answer = json.loads(data)
    first = answer["backend"]
    check("routed request answers 200 with decision headers",
          status == 200 and h.get("x-prefixroute-policy") == "prefix"
          and h.get("x-prefixroute-endpoint") == first and "/" in h.get("x-prefixroute-match", ""),
          f"{status} {first} match={h.get('x-prefixroute-match')}")
    # The client names another replica; the plugin's choice (the prefix holder) must win.
    other = sorted(set(BACKENDS) - {first})[0]
    status, h, data = request("POST", "/v1/chat/completions", chat(tenant(1), "hello again"),
                              {"x-gateway-destination-endpoint": ADDRESS[other]})
    answer = json.loads(data)
    check("client destination header is overwritten with the chosen ip:port",
          answer["backend"] == first and answer["destination_header"] == ADDRESS[first],
          f"client sent {ADDRESS[other]}, {answer['backend']} received "
          f"{answer['destination_header']}")

    # 2. Prefix affinity across many requests (both Envoy workers share the index).
    backends, matches = set(), []
    for i in range(12):
        status, h, data = request("POST", "/v1/chat/completions", chat(tenant(1), f"question {i}"))
        backends.add(json.loads(data)["backend"])
        matches.append(h.get("x-prefixroute-match"))
    check("same system prompt sticks to one replica", backends == {first},
          f"{sorted(backends)} matches {matches[:3]}...")
    m, t = map(int, matches[-1].split("/"))
    check("later requests match the shared prefix", 0 < m < t, matches[-1])

    # 3. New tenants spread over the cold replicas (no-hit-lru).
    spread = {json.loads(request("POST", "/v1/chat/completions", chat(tenant(n), "hi"))[2])["backend"]
              for n in (2, 3)}
    check("cold prefixes spread to other replicas", first not in spread and len(spread) == 2,
          f"tenant1 -> {first}, tenants 2,3 -> {sorted(spread)}")

    # 4. Completions, query string, chunked upload.
    status, h, _ = request("POST", "/v1/completions?trace=1",
                           json.dumps({"model": "m", "prompt": tenant(1)}).encode())
    check("completions with a query string are routed", status == 200
          and h.get("x-prefixroute-policy") == "prefix", f"{status} {h.get('x-prefixroute-match')}")
    status, h, data = request("POST", "/v1/chat/completions", chat(tenant(1), "chunked upload"),
                              chunked=True)
    check("chunked request body is buffered and routed", status == 200
          and h.get("x-prefixroute-policy") == "prefix" and json.loads(data)["backend"] == first,
          f"{status} {h.get('x-prefixroute-endpoint')} {h.get('x-prefixroute-match')}")

    # 5. Non-routable and malformed requests get a fallback destination, never a 5xx.
    cases = [
        ("GET /v1/models", "GET", "/v1/models", None, "not_routable"),
        ("non-JSON body", "POST", "/v1/chat/completions", b"this is not json", "parse_error"),
        ("empty messages", "POST", "/v1/chat/completions", b'{"messages": []}', "parse_error"),
        ("wrong types", "POST", "/v1/completions", b'{"prompt": 42}', "parse_error"),
        ("empty body", "POST", "/v1/chat/completions", b"", None),
        ("body over max_body_bytes", "POST", "/v1/completions",
         json.dumps({"prompt": "x" * (1 << 21)}).encode(), "body_too_large"),
    ]
    for label, method, path, body, reason in cases:
        status, h, data = request(method, path, body,
                                  {"x-gateway-destination-endpoint": "10.1.2.3:9"})
        got = json.loads(data) if data.startswith(b"{") else {}
        ok = (status < 500 and h.get("x-prefixroute-policy") == "fallback"
              and (reason is None or h.get("x-prefixroute-fallback") == reason)
              and got.get("backend") in BACKENDS)
        if got.get("destination_header") is not None:
            ok = ok and got["destination_header"] == ADDRESS[got["backend"]]
        check(f"{label} -> fallback, not 5xx", ok,
              f"{status} fallback={h.get('x-prefixroute-fallback')} backend={got.get('backend')}")

    # 6. Streaming responses pass through unbuffered.
    conn = http.client.HTTPConnection(*ENVOY, timeout=10)
    t0 = time.time()
    conn.request("POST", "/v1/chat/completions", chat(tenant(1), "stream please", stream=True),
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    first_chunk = resp.read1()
    t_first = time.time() - t0
    rest = resp.read()
    t_all = time.time() - t0
    conn.close()
    check("stream: true is routed and SSE arrives incrementally",
          resp.status == 200 and resp.getheader("x-prefixroute-policy") == "prefix"
          and resp.getheader("content-type") == "text/event-stream"
          and first_chunk.startswith(b"data:") and t_first < 0.25 and t_all > 0.8
          and b"[DONE]" in rest,
          f"first chunk after {t_first:.2f}s, all after {t_all:.2f}s")

    # 6b. Bodies arrive intact, including the fallback path that releases a large buffer.
    big = json.dumps({"prompt": "y" * (1 << 21)}).encode()
    small = chat(tenant(1), "integrity")
    sizes = [(len(b), json.loads(request("POST", "/v1/completions", b)[2])["bytes"])
             for b in (small, big)]
    check("request bodies reach the backend byte for byte", all(a == b for a, b in sizes),
          str(sizes))

    # 6c. Concurrency: both workers, many tenants at once, no errors.
    def one(i):
        status, h, data = request("POST", "/v1/chat/completions",
                                  chat(tenant(30 + i % 8), f"concurrent {i}"))
        return status, h.get("x-prefixroute-policy")
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(200)))
    bad = [r for r in results if r != (200, "prefix")]
    check("200 concurrent requests over 16 connections all routed", not bad, f"bad: {bad[:3]}")

    # 6d. Clients that go away: mid-body (while paused) and mid-stream.
    sock = socket.create_connection(ENVOY)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                 b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"mess")
    time.sleep(0.2)
    sock.close()
    conn = http.client.HTTPConnection(*ENVOY, timeout=10)
    conn.request("POST", "/v1/chat/completions", chat(tenant(1), "abandon", stream=True),
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    resp.read1()
    conn.sock.close()
    conn.close()
    time.sleep(1.5)
    stats = envoy_stats()
    inflight = {n: stats.get(f"wasmcustom.prefixroute.endpoint.{n}.in_flight") for n in BACKENDS}
    status, _, _ = request("GET", "/v1/models")
    check("aborted requests release their in-flight count and the VM is fine",
          set(inflight.values()) == {"0"} and status == 200, f"{inflight} then GET -> {status}")

    # 7. One scrape per endpoint per interval across all root contexts (2 workers + main).
    before = {n: backend_stats(n)["scrapes"] for n in BACKENDS}
    time.sleep(5.0)
    after = {n: backend_stats(n) for n in BACKENDS}
    counts = {n: after[n]["scrapes"] - before[n] for n in BACKENDS}
    check("each endpoint scraped once per 500 ms interval (not once per worker)",
          all(8 <= c <= 12 for c in counts.values()), f"scrapes in 5 s: {counts}")
    check("scrape callouts reach the right endpoint (Host = ip:port)",
          all(set(after[n]["scrape_hosts"]) == {ADDRESS[n]} for n in BACKENDS),
          str({n: after[n]["scrape_hosts"][-1] for n in BACKENDS}))

    # 8. Queue pressure moves a tenant off its replica (saturation filter, threshold 5).
    control(first, waiting=20)
    time.sleep(1.2)
    moved = {json.loads(request("POST", "/v1/chat/completions",
                                chat(tenant(1), f"busy {i}"))[2])["backend"] for i in range(4)}
    check("a saturated replica loses its tenant to an idle one", first not in moved,
          f"{first} waiting=20 -> {sorted(moved)}")
    control(first, waiting=0)

    # 9. A failing endpoint is taken out of rotation; no 5xx.
    victim = sorted(set(BACKENDS) - {first})[0]
    control(victim, metrics_status=503)
    time.sleep(1.6)
    stats = envoy_stats()
    down = stats.get(f"wasmcustom.prefixroute.endpoint.{victim}.down")
    routed = [request("POST", "/v1/chat/completions", chat(tenant(n), "q"))
              for n in range(10, 22)]
    used = {json.loads(d)["backend"] for _, _, d in routed}
    check("endpoint with failing scrapes is marked down and avoided",
          down == "1" and victim not in used and all(s == 200 for s, _, _ in routed),
          f"{victim} down gauge={down}, new tenants went to {sorted(used)}")
    control(victim, metrics_status=200)
    time.sleep(1.2)
    stats = envoy_stats()
    check("it comes back after a successful scrape",
          stats.get(f"wasmcustom.prefixroute.endpoint.{victim}.down") == "0"
          and int(stats.get("wasmcustom.prefixroute.endpoint_up", 0)) >= 1)

    # 10. Envoy stats.
    stats = envoy_stats()
    wanted = ["wasmcustom.prefixroute.requests", f"wasmcustom.prefixroute.routed.prefix.{first}",
              "wasmcustom.prefixroute.cold", "wasmcustom.prefixroute.fallback.parse_error",
              "wasmcustom.prefixroute.fallback.not_routable",
              "wasmcustom.prefixroute.fallback.body_too_large",
              "wasmcustom.prefixroute.scrape.ok", "wasmcustom.prefixroute.scrape.failures",
              "wasmcustom.prefixroute.endpoint_down"]
    missing = [w for w in wanted if int(stats.get(w, 0)) <= 0]
    check("Envoy exposes the plugin's stats", not missing, f"missing/zero: {missing}")
    inflight = {n: stats.get(f"wasmcustom.prefixroute.endpoint.{n}.in_flight") for n in BACKENDS}
    check("in-flight gauges return to 0 when streams end", set(inflight.values()) == {"0"},
          str(inflight))
    print("plugin stats:")
    for k, v in sorted(stats.items()):
        if k.startswith("wasmcustom."):
            print(f"  {k}: {v}")

    failed = RESULTS.count(False)
    print(f"{len(RESULTS) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
