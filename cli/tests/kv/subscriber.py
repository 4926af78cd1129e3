"""A KV-event subscriber written the way vLLM's examples/online_serving/kv_events_subscriber.py
is: pyzmq SUB, msgspec structs with vLLM's schema (vllm/distributed/kv_events.py: array_like,
tagged events). It decodes what a publisher sends with vLLM's own rules, so a field in the wrong
place or of the wrong type fails here exactly as it would in a vLLM consumer.

usage: subscriber.py tcp://HOST:PORT COUNT TIMEOUT_S
Prints one JSON line per message: {"topic", "seq", "ts", "rank", "events": [...]}.
"""

import json
import sys
from typing import Any, Optional, Union

import msgspec
import zmq
from msgspec.msgpack import Decoder


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def main() -> int:
    endpoint, count, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    decoder = Decoder(type=KVEventBatch)
    sub = zmq.Context().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@")
    print("subscribed", flush=True, file=sys.stderr)
    got = 0
    while got < count:
        if not sub.poll(int(timeout_s * 1000)):
            print(f"timed out after {got} messages", file=sys.stderr)
            return 1
        topic, seq, payload = sub.recv_multipart()
        batch = decoder.decode(payload)
        events = []
        for e in batch.events:
            fields = {f: getattr(e, f) for f in e.__struct_fields__}
            fields["type"] = type(e).__name__
            events.append(fields)
        print(json.dumps({
            "topic": topic.decode(),
            "seq": int.from_bytes(seq, "big"),
            "ts": batch.ts,
            "rank": batch.data_parallel_rank,
            "events": events,
        }), flush=True)
        got += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
