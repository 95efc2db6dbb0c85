"""KV-cache events on the wire, as vLLM publishes them (``--kv-events-config``).

``serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'`` publishes every engine step's prefix-cache
events (:mod:`minibatch_engine.kv.events`) on a ZeroMQ PUB socket, so a
KV-aware router subscribes to each replica and routes by what it holds.

The framing is vLLM's (``ZmqEventPublisher`` in ``vllm/distributed/kv_events.py``):
one multipart message per engine step with events,

    [topic, sequence number (8 bytes, big-endian, from 0), msgpack payload]

and the payload is an ``EventBatch`` (msgspec ``array_like``): the array
``[ts, events, data_parallel_rank]``. Each event is a msgspec tagged union;
vLLM's two layouts are both here (``event_layout``):

* ``"map"`` (default; vLLM's current structs, what vllm-router 0.1.17 decodes):
  ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
  "token_ids": [...], "block_size": B, "lora_id": None, "medium": "GPU",
  "lora_name": None}``, ``{"type": "BlockRemoved", "block_hashes": [...],
  "medium": "GPU"}``, ``{"type": "AllBlocksCleared"}``;
* ``"array"`` (vLLM's ``array_like`` events, what llm-d's KV-cache indexer
  decodes): the same fields in the same order, as an array whose first element
  is the tag: ``["BlockStored", hashes, parent, token_ids, B, None, "GPU", None]``.

Block hashes go out as unsigned 64-bit integers: the engine's own chained
hashes (Python's ``hash``, a signed 64-bit value) in two's complement. They are
names, not a function a router must reproduce: vllm-router keys its index by
the token ids each ``BlockStored`` carries, llm-d recomputes its own hashes
from them (its "request keys", mapped from the engine's keys), and both use the
engine's hashes only to chain a store to its parent and match a removal to its
store. So the names need not agree across replicas, and they do not: before
Python 3.12 ``hash(None)``, the first block's parent, differs per process.

With ``replay_endpoint``, a ROUTER socket answers a subscriber that missed
messages: it sends ``[b"", start sequence (8 bytes)]`` and receives every
buffered batch from that number on as ``[b"", seq, payload]``, then
``[b"", -1 (8 bytes, signed), b""]``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from ...kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from .json_flag import json_object_flag

U64 = (1 << 64) - 1
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields (the JSON of ``--kv-events-config``),
    plus ``event_layout`` (see the module doc). ``max_queue_size`` is accepted
    for vLLM's configs and unused: events are sent from the engine loop, and a
    PUB socket drops past ``hwm`` rather than block."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None          # "zmq" or "null"; default: zmq when enabled
    endpoint: str = "tcp://*:5557"        # bound when it has a wildcard (or ipc/inproc), else connected
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000            # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_layout: str = "map"

    @classmethod
    def parse(cls, value) -> "KVEventsConfig":
        """From a JSON object (text or dict); an unknown key or a wrong type is a
        ValueError naming the field."""
        value = json_object_flag(value, "--kv-events-config", (f.name for f in fields(cls)))
        types = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int, "max_queue_size": int,
                 "endpoint": str, "topic": str, "event_layout": str}
        for name, v in value.items():
            want = types.get(name)
            if want is not None and (not isinstance(v, want) or (want is int and isinstance(v, bool))):
                raise ValueError(f"--kv-events-config: {name} must be a {want.__name__}, got {v!r}")
        cfg = cls(**value)
        if cfg.publisher not in (None, "zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if cfg.replay_endpoint is not None and not isinstance(cfg.replay_endpoint, str):
            raise ValueError(f"--kv-events-config: replay_endpoint must be a string, got {cfg.replay_endpoint!r}")
        if cfg.event_layout not in ("map", "array"):
            raise ValueError(f"--kv-events-config: event_layout must be 'map' or 'array', got {cfg.event_layout!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"--kv-events-config: {name} must be positive, got {getattr(cfg, name)}")
        return cfg

    @property
    def active(self) -> bool:
        """Whether events are published at all (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def wire_event(event, layout: str = "map"):
    """One event as msgpack-ready data, in vLLM's ``layout`` (module doc)."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else event.parent_block_hash & U64
        items = [("block_hashes", [h & U64 for h in event.block_hashes]), ("parent_block_hash", parent),
                 ("token_ids", list(event.token_ids)), ("block_size", event.block_size),
                 ("lora_id", event.lora_id), ("medium", event.medium), ("lora_name", None)]
    elif isinstance(event, BlockRemoved):
        items = [("block_hashes", [h & U64 for h in event.block_hashes]), ("medium", event.medium)]
    elif isinstance(event, AllBlocksCleared):
        items = []
    else:
        raise TypeError(f"not a KV-cache event: {event!r}")
    tag = type(event).__name__
    if layout == "array":
        return [tag, *(v for _, v in items)]
    return {"type": tag, **dict(items)}


def encode_batch(events, ts: float, layout: str = "map", data_parallel_rank: int = 0) -> bytes:
    """One step's events as vLLM's msgpack ``EventBatch``: ``[ts, events, rank]``."""
    import msgpack
    return msgpack.packb([ts, [wire_event(e, layout) for e in events], data_parallel_rank])


class ZmqEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket with sequence numbers, and
    (with ``replay_endpoint``) answers replay requests from a ROUTER socket on
    its own thread. ``publish`` is called from one thread (the engine loop's)."""

    def __init__(self, config: KVEventsConfig):
        import zmq
        self.config = config
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        ep = config.endpoint
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            self._pub.bind(ep)
        else:
            self._pub.connect(ep)
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self._running = True
        self._replay_thread = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
            self._replay_thread = threading.Thread(target=self._serve_replay, name="kv-events-replay",
                                                   daemon=True)
            self._replay_thread.start()

    @property
    def next_sequence(self) -> int:
        return self._seq

    def publish(self, events, ts: float | None = None) -> None:
        """Send one batch (one engine step's events) as the next sequence number."""
        payload = encode_batch(events, time.time() if ts is None else ts, self.config.event_layout)
        seq = self._seq
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._seq += 1
        if self._replay_thread is not None:
            with self._lock:
                self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        while self._running:
            if not self._replay.poll(100):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue                         # not [identity, b"", start]: ignored, as vLLM does
            client, _, start = frames
            start = int.from_bytes(start, "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in batches:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        """Stop the replay thread and close the sockets."""
        self._running = False
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
            self._replay.close()
        self._pub.close()


def make_publisher(config) -> ZmqEventPublisher | None:
    """The publisher ``config`` (a :class:`KVEventsConfig`, its JSON or dict)
    asks for, or None when events are off."""
    if config is None:
        return None
    cfg = config if isinstance(config, KVEventsConfig) else KVEventsConfig.parse(config)
    if not cfg.active:
        return None
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--kv-events-config needs {e.name}: pip install 'minibatch-engine[serve]'") from None
    return ZmqEventPublisher(cfg)
