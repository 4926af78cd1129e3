#!/usr/bin/env python3
"""Writes configuration variants of a rendered envoy.yaml for `envoy --mode validate`:

    variants.py RENDERED.yaml OUT_DIR

* struct.yaml:  the plugin configuration as a google.protobuf.Struct (YAML map) instead of a
                JSON string (Envoy passes it to the plugin as binary protobuf);
* invalid.yaml: an invalid plugin configuration, which must be refused with one clear line.
"""
import sys

src = open(sys.argv[1]).read()
out = sys.argv[2]
start = src.index("                configuration:")
end = src.index("          - name: envoy.filters.http.router")

STRUCT = """                configuration:
                  "@type": type.googleapis.com/google.protobuf.Struct
                  value:
                    endpoints:
                    - {name: replica-1, address: "127.0.0.1:18001"}
                    - {name: replica-2, address: "127.0.0.1:18002"}
                    policy: least-queue
                    block_size: 32
                    scrape: {interval_ms: 1000, timeout_ms: 300, stale_after_ms: 5000}
"""
INVALID = """                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{"endpoints": [{"name": "a", "address": "x"}]}'
"""
for name, block in (("struct", STRUCT), ("invalid", INVALID)):
    with open(f"{out}/{name}.yaml", "w") as f:
        f.write(src[:start] + block + src[end:])
