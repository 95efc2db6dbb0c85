"""A standalone server's memory over many streams: `serve --model tiny-py`, loopback only.

Starts a server in a subprocess, sends waves of streamed completions (40% of
the clients leave after a few tokens), and prints the server's resident size
every 250 streams, then its running/KV gauges (both back to 0). Bounded by a
stream count and a deadline:

    python benchmarks/server_memory.py [STREAMS=4000] [CONCURRENCY=50] [DEADLINE_S=400]

Run it with and without MALLOC_ARENA_MAX=8 in the environment to see what the
server's arena cap (minibatch_engine/entrypoints/server/memory.py) does; book/how_to_run.md
has the numbers.
"""
import asyncio
import random
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

async def main(total, conc, deadline_s):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minibatch_engine", "serve", "--model", "tiny-py", "--port", str(port),
                             "--max-batch", "32"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    args = sys.argv[1:] + ["4000", "50", "400"][len(sys.argv[1:]):]
    asyncio.run(main(int(args[0]), int(args[1]), float(args[2])))
