"""The architecture page's import rules, checked on the source: no import
circles between the package's modules, and no import from a layer back up
(function-level imports count too: a lazy import is still a dependency)."""
import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minibatch_engine"

# Lowest first. A module may import from its own layer or below, never above.
LAYERS = [
    {"device", "inputs", "sampling", "request", "outputs"},
    {"attention", "kv"},
    {"model", "sim"},
    {"scheduler", "speculative"},
    {"runner"},
    {"config", "trace", "metrics", "profiling", "workload"},
    {"engine"},
    {"llm", "async_llm", "bench", "sweep", "vs_transformers", "book"},
    {"cli", "__main__", ""},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


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
    top = lambda m: m.split(".")[0]   # noqa: E731
    assert set(map(top, _modules())) <= set(LAYER), "a new top-level module needs a layer here"
    upward = [f"{a} -> {b}" for a, bs in import_graph().items() for b in bs if LAYER[top(b)] > LAYER[top(a)]]
    assert upward == []


def test_the_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
