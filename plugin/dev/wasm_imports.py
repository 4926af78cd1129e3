#!/usr/bin/env python3
"""Lists a .wasm module's imports and exported functions (no dependencies).

Used to check that the plugin links only proxy-wasm ABI 0.2.1 host functions (module "env")
and WASI preview1 (module "wasi_snapshot_preview1").

    python3 plugin/dev/wasm_imports.py /tmp/target-plugin/wasm32-wasip1/wasm/prefixroute_plugin.wasm
"""
import sys


def leb(data, pos):
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, pos


def name(data, pos):
    n, pos = leb(data, pos)
    return data[pos:pos + n].decode(), pos + n


def main(path):
    data = open(path, "rb").read()
    assert data[:4] == b"\0asm", "not a wasm module"
    pos = 8
    imports, exports = [], []
    while pos < len(data):
        section, pos = data[pos], pos + 1
        size, pos = leb(data, pos)
        end = pos + size
        if section == 2:  # imports
            count, p = leb(data, pos)
            for _ in range(count):
                module, p = name(data, p)
                field, p = name(data, p)
                kind, p = data[p], p + 1
                if kind == 0:
                    _, p = leb(data, p)
                elif kind == 1:
                    p += 1
                    flags, p = leb(data, p)
                    _, p = leb(data, p)
                    if flags & 1:
                        _, p = leb(data, p)
                elif kind == 2:
                    flags, p = leb(data, p)
                    _, p = leb(data, p)
                    if flags & 1:
                        _, p = leb(data, p)
                elif kind == 3:
                    p += 2
                imports.append((module, field, kind))
        elif section == 7:  # exports
            count, p = leb(data, pos)
            for _ in range(count):
                field, p = name(data, p)
                kind, p = data[p], p + 1
                _, p = leb(data, p)
                exports.append((field, kind))
        pos = end
    print(f"{len(imports)} imports:")
    for module, field, _ in imports:
        print(f"  {module}.{field}")
    print(f"{len(exports)} exports:")
    for field, kind in exports:
        print(f"  {field}{'' if kind == 0 else ' (non-function)'}")
    bad = [i for i in imports if i[0] not in ("env", "wasi_snapshot_preview1")]
    if bad:
        sys.exit(f"unexpected import modules: {bad}")


if __name__ == "__main__":
    main(sys.argv[1])
