"""KV-cache events in vLLM's format: the block manager records what enters and
leaves its prefix cache, and the server's ZeroMQ publisher sends it framed as
vLLM frames it. The payloads are decoded here with msgpack alone, against the
layout written out from vLLM's source (``vllm/distributed/kv_events.py``:
``EventBatch`` is ``array_like``; ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared`` are tagged structs, their fields in declaration order)."""
import asyncio

import pytest

from minibatch_engine.kv import BlockManager, chain_hash
from minibatch_engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from minibatch_engine.entrypoints.server.kv_events import (  # noqa: E402
    KVEventsConfig, ZmqEventPublisher, make_publisher)

U64 = (1 << 64) - 1

# vLLM's structs, field by field (the tag first): what a subscriber decodes.
STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
REMOVED_FIELDS = ["block_hashes", "medium"]


def expected_wire(event, layout):
    """``event`` as vLLM's msgspec encoder lays it out (written independently of the publisher)."""
    if isinstance(event, BlockStored):
        values = [[h & U64 for h in event.block_hashes],
                  None if event.parent_block_hash is None else event.parent_block_hash & U64,
                  list(event.token_ids), event.block_size, None, "GPU", None]
        names = STORED_FIELDS
    elif isinstance(event, BlockRemoved):
        values, names = [[h & U64 for h in event.block_hashes], "GPU"], REMOVED_FIELDS
    else:
        values, names = [], []
    tag = type(event).__name__
    return [tag, *values] if layout == "array" else {"type": tag, **dict(zip(names, values))}


# --- the block manager's record -------------------------------------------------------
def test_events_are_off_by_default_and_cost_nothing():
    m = BlockManager(4, 2)
    m.allocate("a", 4)
    m.mark_computed("a", [1, 2, 3, 4], 4)
    assert m.events is None and m.take_events() == []


def test_stores_evictions_and_a_reset_are_recorded_in_order_with_the_chain():
    m = BlockManager(4, 2)
    m.record_events()
    m.allocate("a", 5)
    m.mark_computed("a", [1, 2, 3, 4, 5], 5)          # two full blocks; the fifth token's block is not full
    h1 = chain_hash(None, (1, 2))
    h2 = chain_hash(h1, (3, 4))
    assert m.take_events() == [BlockStored((h1, h2), None, (1, 2, 3, 4), 2)]
    m.mark_computed("a", [1, 2, 3, 4, 5, 6], 6, 5)    # decode fills the third block: its parent is h2
    h3 = chain_hash(h2, (5, 6))
    assert m.take_events() == [BlockStored((h3,), h2, (5, 6), 2)]
    m.free_request("a")                               # freed, still cached: nothing to report
    assert m.take_events() == []
    m.allocate("b", 4)                                # takes the unused block, then evicts h3 (freed first)
    assert m.take_events() == [BlockRemoved((h3,))]
    m.free_request("b")
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]
    assert m.cached == {}


def test_evicting_a_parent_also_reports_its_cached_children():
    m = BlockManager(3, 2)
    m.record_events()
    m.allocate("a", 4)
    m.mark_computed("a", [1, 2, 3, 4], 4)
    h1 = chain_hash(None, (1, 2))
    h2 = chain_hash(h1, (3, 4))
    m.take_events()
    m.free_request("a")                # blocks return child first: the child is evicted first
    m.allocate("b", 6)                 # needs all three blocks
    assert m.take_events() == [BlockRemoved((h2,)), BlockRemoved((h1,))]


def test_reset_is_refused_while_a_request_holds_blocks():
    m = BlockManager(4, 2)
    m.record_events()
    m.allocate("a", 2)
    assert not m.reset_prefix_cache() and m.take_events() == []


def test_a_cache_without_prefix_caching_refuses_to_record():
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(4, 2, enable_prefix_caching=False).record_events()


# --- the configuration ------------------------------------------------------------------
def test_config_reads_vllms_json_and_refuses_unknown_fields_by_name():
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv"}')
    assert cfg.active and cfg.publisher is None and cfg.buffer_steps == 10_000
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).active
    assert make_publisher({"enable_kv_cache_events": False}) is None
    with pytest.raises(ValueError, match="unknown field.*endpont"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="hwm must be a int"):
        KVEventsConfig.parse({"hwm": "10"})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse({"publisher": "kafka"})
    with pytest.raises(ValueError, match="event_layout"):
        KVEventsConfig.parse({"event_layout": "json"})


# --- a small engine, its tiny pool forcing evictions, seen from a subscriber -------------------
class Tee:
    """The engine's events as handed to the publisher (the reference), then published."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def publish(self, events):
        self.batches.append(list(events))
        self.inner.publish(events)


def replay(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Every buffered batch from ``start`` on, asked of the replay socket as vLLM's clients ask."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    try:
        while True:
            assert sock.poll(20_000), "the replay socket did not answer"
            _, seq, payload = sock.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return out
            out.append((seq, payload))
    finally:
        sock.close()


def free_tcp_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout", ["map", "array"])
def test_a_subscriber_sees_exactly_the_blocks_the_engine_stores_and_evicts(layout):
    from minibatch_engine.entrypoints.async_llm import AsyncLLM
    from minibatch_engine import SamplingParams
    pub_port, replay_port = free_tcp_port(), free_tcp_port()
    cfg = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}",
                                "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv@test",
                                "event_layout": layout})
    publisher = ZmqEventPublisher(cfg)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    tee = Tee(publisher)
    llm = AsyncLLM("tiny", device="cpu", attention_backend="sdpa", max_num_seqs=2, max_model_len=32,
                   block_size=4, num_kv_blocks=10, step_in_thread=False, kv_event_publisher=tee)
    # Six 13-token prompts, two sharing an 8-token start, then the first again: 10 blocks
    # of 4 tokens hold about two requests, so later ones evict earlier ones' blocks.
    prompts = [[(7 * i + j) % 50 + 1 for j in range(13)] for i in range(6)]
    prompts[3][:8] = prompts[2][:8]
    prompts.append(list(prompts[0]))

    async def run():
        for p in prompts:
            async for _ in llm.stream(p, SamplingParams(max_tokens=4, ignore_eos=True)):
                pass
        await llm.shutdown()
    try:
        asyncio.run(run())
        manager = llm.engine.kv_cache.manager
        frames = replay(f"tcp://127.0.0.1:{replay_port}")
        live = []
        while sub.poll(1000):
            live.append(sub.recv_multipart())
    finally:
        sub.close()
        publisher.close()

    # The framing: consecutive sequence numbers from 0, one batch per step with events.
    assert [s for s, _ in frames] == list(range(len(tee.batches)))
    decoded = [msgpack.unpackb(p) for _, p in frames]
    for batch, events in zip(decoded, tee.batches):
        assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0
        ordered = lambda ev: list(ev.items()) if isinstance(ev, dict) else ev     # noqa: E731 (field order too)
        assert [ordered(ev) for ev in batch[1]] == [ordered(expected_wire(e, layout)) for e in events]
    # What arrived live is the same messages (a subscriber may join late: a suffix).
    assert live, "the subscriber received nothing"
    first = int.from_bytes(live[0][1], "big")
    assert [(t, int.from_bytes(s, "big"), p) for t, s, p in live] == \
        [(b"kv@test", s, p) for s, p in frames[first:]]

    # Replaying the events rebuilds the engine's prefix cache exactly, in order.
    events = [e for batch in tee.batches for e in batch]
    held: dict[int, tuple] = {}
    for e in events:
        if isinstance(e, BlockStored):
            assert e.parent_block_hash is None or e.parent_block_hash in held
            assert len(e.token_ids) == len(e.block_hashes) * 4
            for k, h in enumerate(e.block_hashes):
                assert h not in held
                held[h] = e.token_ids[4 * k:4 * k + 4]
        else:
            for h in e.block_hashes:
                assert held.pop(h) is not None
    assert held == {h: manager.blocks[b].tokens for h, b in manager.cached.items()}
    assert any(isinstance(e, BlockRemoved) for e in events), "the tiny pool should have evicted"


def test_serve_refuses_a_bad_kv_events_config_by_name_before_loading_the_model(capsys):
    from minibatch_engine.entrypoints.cli import main
    assert main(["serve", "--model", "tiny", "--port", "0", "--kv-events-config",
                 '{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}']) == 2
    assert "--kv-events-config: unknown field(s) endpont" in capsys.readouterr().err


def test_serve_publishes_its_steps_and_a_reset_prefix_cache_as_all_blocks_cleared():
    pytest.importorskip("aiohttp")
    from minibatch_engine.entrypoints.server import ServerThread, make_app
    from .server_fixtures import post
    pub, replay_port = free_tcp_port(), free_tcp_port()
    app = make_app("tiny", device="cpu", attention_backend="sdpa", max_num_seqs=4, max_model_len=128, block_size=4,
                   kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                                     "replay_endpoint": f"tcp://*:{replay_port}"})
    with ServerThread(app) as s:
        status, body, _ = post(s.url, {"prompt": list(range(1, 12)), "max_tokens": 2, "ignore_eos": True,
                                         "temperature": 0})   # a drawn EOS would end it one token early
        assert status == 200, body
        assert post(s.url, {}, path="/reset_prefix_cache")[:2] == (200, {"reset": True})
        batches = [msgpack.unpackb(p) for _, p in replay(f"tcp://127.0.0.1:{replay_port}")]
        assert s.llm.engine.kv_cache.manager.cached == {}
    stored = [e for b in batches[:-1] for e in b[1]]
    assert stored and all(e["type"] == "BlockStored" for e in stored)
    tokens = [t for e in stored for t in e["token_ids"]]
    assert len(tokens) == 12 and tokens[:11] == list(range(1, 12))   # three full blocks: 11 prompt tokens, 1 sampled
    assert batches[-1][1] == [{"type": "AllBlocksCleared"}]


def test_reset_prefix_cache_asks_for_the_api_key():
    pytest.importorskip("aiohttp")
    from minibatch_engine.entrypoints.server import ServerThread, make_app
    from .server_fixtures import post
    with ServerThread(make_app("tiny", device="cpu", attention_backend="sdpa", max_model_len=64,
                               api_keys=["k"])) as s:
        assert post(s.url, {}, path="/reset_prefix_cache")[0] == 401
