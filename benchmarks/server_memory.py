"""A standalone server's memory over many streams: `serve --model tiny-py`, loopback only.

Starts a server in a subprocess, sends waves of streamed completions (40% of
the clients leave after a few tokens), and prints the server's resident size
every 250 streams, then its running/KV gauges (both back to 0). Bounded by a
stream count and a deadline:

    python benchmarks/server_memory.py [STREAMS=4000] [CONCURRENCY=50] [DEADLINE_S=400]

Run it with and without MALLOC_ARENA_MAX=8 in the environment to see what the
server's arena cap (minibatch_engine/entrypoints/server/memory.py) does; book/how_to_run.md
has the numbers. With --tracemalloc (first argument) the server traces Python's
allocations and prints, once stopped, the 5 source lines whose holdings grew most
since it first answered (the server runs slower then: its resident size is not
comparable).
"""
import asyncio
import random
import signal
import socket
import subprocess
import sys
import time

import aiohttp

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

async def one(session, url, rng):
    body = {"model": "tiny-py", "prompt": "def " + "x" * rng.randint(1, 200), "max_tokens": rng.randint(8, 128),
            "temperature": 0.8, "stream": True, "ignore_eos": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            n = 0
            cut = rng.random() < 0.4
            async for _ in r.content:
                n += 1
                if cut and n > rng.randint(1, 20):
                    break
    except Exception:
        pass

TRACED = """import signal, sys, tracemalloc
tracemalloc.start()
from minibatch_engine.entrypoints.cli import main
base, skip = [], [tracemalloc.Filter(False, tracemalloc.__file__)]
signal.signal(signal.SIGUSR1, lambda *a: base.append(tracemalloc.take_snapshot().filter_traces(skip)))
try:
    main(sys.argv[1:])
finally:
    diff = tracemalloc.take_snapshot().filter_traces(skip).compare_to(base[0], "lineno")
    print(f"traced Python allocations grew {sum(d.size_diff for d in diff) / 2**20:.1f} MiB since the first answer")
    for d in diff[:5]:
        print(f"{d.size_diff / 2**20:+7.2f} MiB {d.count_diff:+8d} blocks  {d.traceback[0].filename}:{d.traceback[0].lineno}")
"""


async def main(total, conc, deadline_s, traced=False):
    port = free_port()
    head = [sys.executable, "-c", TRACED] if traced else [sys.executable, "-m", "minibatch_engine"]
    proc = subprocess.Popen(head + ["serve", "--model", "tiny-py", "--port", str(port), "--max-batch", "32"],
                            stdout=None if traced else subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200: break
            except Exception: pass
            await asyncio.sleep(0.5)
            if time.time() - t0 > 300: raise SystemExit("no server")
        if traced:
            proc.send_signal(signal.SIGUSR1)            # the baseline snapshot
        rng = random.Random(0)
        done = 0
        print(f"start rss {rss_mb(proc.pid):.0f} MB", flush=True)
        while done < total and time.time() - t0 < deadline_s:
            await asyncio.gather(*(one(s, url, rng) for _ in range(conc)))
            done += conc
            if done % 250 == 0:
                print(f"{done} streams: rss {rss_mb(proc.pid):.0f} MB ({time.time()-t0:.0f} s)", flush=True)
        async with s.get(url + "/metrics") as r:
            m = await r.text()
        print([l for l in m.splitlines() if l.startswith("minibatch:num_requests_running") or l.startswith("minibatch:kv_cache_usage_perc")])
    proc.terminate(); proc.wait(30)

if __name__ == "__main__":
    traced = sys.argv[1:2] == ["--tracemalloc"]
    given = sys.argv[1 + traced:]
    args = given + ["4000", "50", "400"][len(given):]
    asyncio.run(main(int(args[0]), int(args[1]), float(args[2]), traced))
