"""The architecture page's import rules, checked on the source: no import
circles between the package's modules, and no import from a layer back up
(function-level imports count too: a lazy import is still a dependency)."""
import ast
from collections import defaultdict
from pathlib import Path

import torch

from minibatch_engine import Engine, SamplingParams, reference_generate

PACKAGE = Path(__file__).resolve().parents[2] / "minibatch_engine"

# Lowest first. A module may import from its own layer or below, never above. A name
# stands for that module and everything under it; a module's layer is its longest name here
# (core/ and harness/ hold modules of several layers: a new module there starts at the bottom,
# where an import from above it fails the check).
LAYERS = [
    {"core", "core.checks", "core.device", "core.inputs", "core.request", "core.outputs", "core.stop_strings",
     "sampling", "entrypoints", "harness"},
    {"attention", "kv"},
    {"model", "sim"},
    {"scheduler", "speculative"},
    {"runner"},
    {"config", "core.trace", "core.engine_stats", "harness.metrics", "harness.profiling", "harness.workload",
     "harness.request_traces", "harness.machine_limit", "harness.utilization"},
    {"core.engine"},
    {"llm", "entrypoints.async_llm", "harness.bench", "harness.sweep", "harness.vs_transformers", "harness.vs_openvino",
     "harness.cpu_engines",
     "book", "cluster"},
    {"entrypoints.server", "harness.endpoint_client", "harness.router_compare"},   # HTTP: the server, its load client, routers compared
    {"entrypoints.cli", "__main__", ""},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def layer(module: str) -> int:
    """The layer of ``module``: that of the longest name in LAYERS it is, or lies under."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER:
            return LAYER[".".join(parts[:n])]
    return None


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (relative imports, at any depth)."""
    mods, edges = _modules(), defaultdict(set)
    for name, path in mods.items():
        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        pkg = [p for p in pkg if p]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = pkg[:len(pkg) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            target = ".".join(base)
            subs = [f"{target}.{a.name}".lstrip(".") for a in node.names]
            subs = [s for s in subs if s in mods]
            for t in (subs if len(subs) == len(node.names) else [target, *subs]):
                if t in mods and t != name:
                    edges[name].add(t)
    return edges


def _cycles(edges) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circles():
    assert _cycles(import_graph()) == []


def test_no_module_imports_from_a_layer_above_it():
    unplaced = sorted(m for m in _modules() if layer(m) is None)
    assert unplaced == [], "a new top-level module needs a layer here"
    upward = [f"{a} -> {b}" for a, bs in import_graph().items() for b in bs if layer(b) > layer(a)]
    assert upward == []


def test_every_layer_name_is_a_module():
    """A name in LAYERS that no longer exists would place nothing."""
    assert sorted(n for n in LAYER if n not in _modules()) == []



def test_the_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _tensors_reachable(obj, seen=None, depth=0):
    """Every torch.Tensor reachable from ``obj`` through attributes and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 12 or isinstance(obj, (str, bytes, int, float, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        items = list(obj)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) + [s for c in type(obj).__mro__
                                                        for s in getattr(c, "__slots__", ())]
        items = [getattr(obj, n, None) for n in names]
    else:
        return []
    return [t for item in items for t in _tensors_reachable(item, seen, depth + 1)]


def test_the_scheduler_holds_no_tensor_and_schedule_moves_no_kv_bytes(tiny64):
    """Forks (copy-on-write) and swap preemption: the scheduler decides the
    copies, the runner makes them; while schedule() runs, not a byte of the
    device or host KV pool changes."""
    engine = Engine(tiny64, max_num_seqs=4, max_model_len=48, block_size=4, num_kv_blocks=14, watermark=0.0,
                    preemption_mode="swap", swap_space_bytes=2**20, max_num_batched_tokens=8)
    assert _tensors_reachable(engine.scheduler) == []
    pools = [engine.runner.kv_pool.kv, engine.runner.host_pool.pool.kv]
    schedule, kinds = engine.scheduler.schedule, set()

    def watched(now=None):
        before = [p.clone() for p in pools]
        out = schedule(now)
        assert all(torch.equal(a, b) for a, b in zip(before, pools))
        kinds.update(c.kind for c in out.block_copies)
        return out
    engine.scheduler.schedule = watched
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13, 14, 15]]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=16, n=2, ignore_eos=True)) for p in prompts]
    engine.run()
    assert kinds == {"copy", "swap_out", "swap_in"}          # every kind of copy happened
    for r, p in zip(reqs, prompts):
        assert [s.output_token_ids for s in engine.samples_of(r.request_id)] == \
            [reference_generate(tiny64, p, 16)] * 2


def test_a_waiting_request_is_hashed_once_not_every_step(tiny64):
    """vLLM keeps a request's block hashes on the request; a head-of-line request
    that cannot be admitted used to be rehashed, block by block, every step."""
    engine = Engine(tiny64, max_num_seqs=2, max_model_len=64, block_size=4, num_kv_blocks=14, watermark=0.0)
    hashed = []
    real = engine.kv_cache.manager.hash_fn
    engine.kv_cache.manager.hash_fn = lambda parent, tokens: hashed.append(tokens) or real(parent, tokens)
    first = engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=12, ignore_eos=True))
    waiting = engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=2, ignore_eos=True))
    mine = {tuple(range(100 + i, 104 + i)) for i in range(0, 40, 4)}
    while not first.is_finished:
        engine.step()                          # the second waits for KV blocks, step after step
        assert waiting.num_computed_tokens == 0
    looked = [t for t in hashed if t in mine]
    assert len(looked) == len(set(looked)) == 9          # each of its 9 full prompt blocks, once
    engine.run()
    assert waiting.output_token_ids == reference_generate(tiny64, list(range(100, 140)), 2)


def test_each_owner_validates_its_own_knobs_behind_the_flat_interface():
    """EngineConfig keeps one flat keyword interface; each owner's config checks
    its own fields, and EngineConfig only what crosses owners."""
    import pytest

    from minibatch_engine import EngineConfig
    from minibatch_engine.kv.config import CacheConfig
    from minibatch_engine.runner.config import RunnerConfig
    from minibatch_engine.scheduler.config import SchedulerConfig
    from minibatch_engine.sim.config import SimConfig
    cfg = EngineConfig(max_num_seqs=8, block_size=4, attention_backend="sdpa", sim_gpu="H100-SXM")
    assert cfg.scheduler_config == SchedulerConfig(max_num_seqs=8)
    assert cfg.cache_config == CacheConfig(block_size=4)
    assert cfg.runner_config == RunnerConfig(attention_backend="sdpa")
    assert cfg.sim_config == SimConfig(sim_gpu="H100-SXM")
    for owner, kwargs, field in [(SchedulerConfig, dict(max_num_seqs=0), "max_num_seqs"),
                                 (CacheConfig, dict(watermark=1.0), "watermark"),
                                 (RunnerConfig, dict(attention_backend="cuda"), "attention_backend"),
                                 (SimConfig, dict(step_overhead_s=-1), "step_overhead_s")]:
        with pytest.raises(ValueError, match=field):
            owner(**kwargs)
        with pytest.raises(ValueError, match=field):      # the same message through the flat interface
            EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="reserved cache"):  # a rule across owners stays with EngineConfig
        EngineConfig(scheduler="static", kv_layout="paged")
