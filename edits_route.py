"""Chapter 12: the section "A real router in front of real servers" (issue 32,
item 3). Re-appliable: the cells it inserts carry ``metadata.edits_route``; a
second run removes them and inserts them again, before the cell that opens
with ANCHOR (the map section).

    python edits_route.py [chapters/12_many_engines.ipynb]

Then re-execute the chapter (the new cells take about 30 s)."""
import json
import sys

PATH = sys.argv[1] if len(sys.argv) > 1 else "chapters/12_many_engines.ipynb"
ANCHOR = "(ch12-map)=\n## The map"
MARK = "edits_route"

INTRO = """(ch12-http-router)=
## A real router in front of real servers

The policies above ran in the simulator, where the router could read any
number it liked. A router in front of HTTP servers knows only what passes
through it and what the servers publish. `minibatch-engine route` is such a
router: an aiohttp process that speaks OpenAI's API, as chapter 11's server
does, and forwards each request to one backend, chosen by one of the four
policies above. It fills each backend's `ReplicaState` from three sources:

* `outstanding`: its own count of requests sent there and not yet ended (exact,
  since every request passes through it);
* `kv_usage`: the backend's `minibatch:kv_cache_usage_perc` gauge (vLLM's
  `vllm:kv_cache_usage_perc`), polled from its `/metrics` twice a second, so
  up to half a second old;
* `prefix_tokens`: its own `PrefixIndex` of what it sent where, keyed by the
  prompt's token ids in blocks of 16 (a text prompt is keyed by the served
  model's tokenizer when the router is given `--model`, else by its bytes).

The reply streams back unchanged, chunk by chunk. A client that hangs up
closes the router's connection to the backend, which aborts the request there
and frees its KV blocks (chapter 11). The router's own `/metrics` counts the
requests it sent to each backend, and repeats each backend's series with a
`backend` label, so a client that sums a counter over labels reads the
cluster's total.

The cell below starts two `tiny-py` servers and a router in this process, and
runs chapter 8's open-loop client (`bench --endpoint`) through the router on
the multi-turn workload, once per policy. The servers are fresh for each
policy, so their caches start empty. They keep every request
(`history=None`), so the cell can count, per server, the prompt tokens its
prefix cache served."""

IMPORTS = '''import urllib.request

from minibatch_engine.endpoint_client import bench_endpoint
from minibatch_engine.server import ServerThread, make_app
from minibatch_engine.server.metrics import parse_metrics
from minibatch_engine.server.router_app import build_router_app
from minibatch_engine.workload import make_workload'''

RUN = '''ROUTER = "minibatch_router:"


def through_router(policy, num_requests=32, arrival_rate=8.0):
    """Two fresh tiny-py servers, a router in front, multi-turn traffic through it."""
    servers = [ServerThread(make_app("tiny-py", device="cpu", max_model_len=1024,
                                     history=None)).start() for _ in range(2)]
    try:
        app = build_router_app([s.url for s in servers], policy=policy)
        with ServerThread(app) as router:
            summary = bench_endpoint(router.url, workload="multi-turn", seed=0,
                                     num_requests=num_requests,
                                     arrival_rate=arrival_rate, progress=False)
            with urllib.request.urlopen(f"{router.url}/metrics") as r:
                seen = parse_metrics(r.read().decode())
        rows = []
        for i, s in enumerate(servers):
            done = list(s.llm.engine.requests.values())
            at = f'{{backend="{s.url}"}}'
            rows.append(dict(
                backend=i, routed=int(seen[f"{ROUTER}requests_routed_total{at}"]),
                expected=int(seen[f"{ROUTER}expected_prefix_hit_tokens_total{at}"]),
                prompt=sum(r.num_prompt_tokens for r in done),
                hits=sum(r.num_cached_tokens for r in done)))
        return summary, rows
    finally:
        for s in servers:
            s.stop()


runs = {policy: through_router(policy) for policy in ("round-robin", "prefix")}'''

TABLE = '''def _hit_share(rows):
    return sum(r["hits"] for r in rows) / sum(r["prompt"] for r in rows)


turns = make_workload("multi-turn", 32, seed=0, arrival_rate=8.0)
opening = {s.client_id for s in turns}
glue("route_requests", 32, display=False)
glue("route_first_turns", len(opening), display=False)
table = []
for policy, (summary, rows) in runs.items():
    tag = {"round-robin": "rr", "prefix": "px"}[policy]
    glue(f"route_{tag}_hit", _hit_share(rows), display=False)
    glue(f"route_{tag}_hits", sum(r["hits"] for r in rows), display=False)
    glue(f"route_{tag}_expected", sum(r["expected"] for r in rows), display=False)
    glue(f"route_{tag}_ttft", summary["ttft_ms_mean"], display=False)
    glue(f"route_{tag}_failed", summary["failed_requests"], display=False)
    for i, r in enumerate(rows):
        glue(f"route_{tag}_routed{i}", r["routed"], display=False)
        table.append([policy, r["backend"], r["routed"], r["prompt"], r["expected"],
                      r["hits"], r["hits"] / r["prompt"]])
    table.append([policy, "all", summary["completed"], sum(r["prompt"] for r in rows),
                  sum(r["expected"] for r in rows), sum(r["hits"] for r in rows),
                  _hit_share(rows)])
Table(table, ["policy", "backend", "requests", "prompt tokens", "router expected",
              "cache hits", "hit share"], floatfmt=".2f")'''

DETERMINISTIC = '''[r["routed"] for r in runs["round-robin"][1]]'''

AFTER = """Round-robin sent the backends {glue:text}`route_rr_routed0:d` and
{glue:text}`route_rr_routed1:d` requests, the same split on every run (the
last cell prints it). Its prefix caches
served {glue:text}`route_rr_hit:.0%` of prompt tokens: a conversation's next
turn found its history only when it happened to land where the last turn
went. Prefix affinity sent {glue:text}`route_px_routed0:d` and
{glue:text}`route_px_routed1:d` (this split depends on timing, through the
load guard) and its caches served {glue:text}`route_px_hit:.0%`. Of the
{glue:text}`route_requests:d` requests, {glue:text}`route_first_turns:d` open
a conversation, and no cache holds a new conversation's prompt: the gap is in
the later turns. The router's index expected
{glue:text}`route_px_expected:,d` hit tokens under affinity; the servers found
{glue:text}`route_px_hits:,d`. The two can differ: a server may have evicted
a block the router still lists, or not yet computed one when the next turn
arrived. The mean time to first token was {glue:text}`route_rr_ttft:.0f` ms
with round-robin and {glue:text}`route_px_ttft:.0f` ms with affinity; a
one-layer model's prefill costs little, so a hit saves little time here.

Outside a notebook the same cluster is three commands:

```bash
minibatch-engine serve --model tiny-py --port 8001 &
minibatch-engine serve --model tiny-py --port 8002 &
minibatch-engine route --backend http://127.0.0.1:8001 \\
    --backend http://127.0.0.1:8002 --policy prefix --port 8000 &
minibatch-engine bench --endpoint http://127.0.0.1:8000 --workload multi-turn
```"""


def cell(kind, source, tags=None, n=[0]):
    n[0] += 1
    c = {"cell_type": kind, "id": f"edits-route-{n[0]}", "metadata": {MARK: True},
         "source": source.splitlines(keepends=True)}
    if tags:
        c["metadata"]["tags"] = tags
    if kind == "code":
        c.update(execution_count=None, outputs=[])
    return c


def main() -> None:
    with open(PATH) as f:
        nb = json.load(f)
    cells = [c for c in nb["cells"] if not c.get("metadata", {}).get(MARK)]
    at = [i for i, c in enumerate(cells) if "".join(c["source"]).startswith(ANCHOR)]
    if len(at) != 1:
        raise SystemExit(f"{PATH}: expected one cell opening with {ANCHOR!r}, found {len(at)}")
    new = [cell("markdown", INTRO), cell("code", IMPORTS, ["hide-input"]), cell("code", RUN, ["nbval-ignore-output"]),
           cell("code", TABLE, ["hide-input", "nbval-ignore-output"]),
           cell("code", DETERMINISTIC), cell("markdown", AFTER)]
    nb["cells"] = cells[:at[0]] + new + cells[at[0]:]
    with open(PATH, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"{PATH}: {len(new)} cells before {ANCHOR.splitlines()[-1]!r}")


if __name__ == "__main__":
    main()
