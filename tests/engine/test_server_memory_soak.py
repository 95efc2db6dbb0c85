"""A standalone server's memory under a long run (issue 38, item 11). The
in-process soak (test_memory_soak.py) trims the heap after every wave, which
hides the allocator growth that a long-running server met: glibc's malloc
arenas, one per allocating thread, each keeping freed pieces
(entrypoints/server/memory.py caps them at two). Here ``serve`` runs in a
subprocess, untouched: waves of streams, 40% of the clients leaving midway,
the server's resident size (VmRSS) read after each wave. Two checks:

* the server allocates from at most one arena besides the main one (the cap,
  ``M_ARENA_MAX=2``, counts the main arena; with ``MALLOC_ARENA_MAX=64`` the
  soak leaves three on this book's two-core machine). Each of
  glibc's 64 MiB non-main heaps (found in ``/proc/PID/maps``) begins with a
  pointer to the arena it belongs to (``heap_info.ar_ptr``), read through
  ``/proc/PID/mem``; an arena that grows takes more heaps, so the heaps are
  counted by arena, not one by one;
* over the second half of the waves the resident size grows by at most
  :data:`GROWTH_KIB_PER_STREAM` a stream (the issue's uncapped server averaged
  320 KiB over 4,000 streams).

The resident size does not level off within a minute: on this machine it grew
about 100 KiB a stream over the first 1,000 streams, capped or not (the
benchmark levels off from about 1,500 streams; book/how_to_run.md). Bounded by wall
time; it asserts only on the waves it completed."""
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")

from .server_fixtures import IDLE, free_port, wait_idle, wait_started  # noqa: E402

PER_WAVE, BUDGET_S, MIN_WAVES = 32, 40.0, 10
PROMPT_LENGTHS = (5, 20, 60, 150)      # few shapes: torch caches per shape would otherwise look like growth
GROWTH_KIB_PER_STREAM = 200    # allowed over the second half of the waves
HEAP = 64 * 2**20              # glibc's non-main heap: HEAP_MAX_SIZE on 64-bit, aligned to its size


#: ``serve`` as the CLI starts it (make_app caps the arenas first), with a short
#: history so that the trace is full within the first waves (its warm-up)
SERVER = ("from minibatch_engine.entrypoints.server import make_app, serve\n"
          "serve(make_app('tiny', device='cpu', attention_backend='sdpa', max_num_seqs=32, max_model_len=512,"
          " kv_budget_bytes=8 * 2**20, history=64), port={port})")


def vm_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def malloc_arenas(pid: int) -> int:
    """glibc's non-main arenas in ``pid``: the distinct owners (``ar_ptr``, the
    first word of each heap) of its non-main heaps, which are anonymous
    read-write mappings at a multiple of :data:`HEAP`, spanning exactly HEAP with
    their reserved tail."""
    maps = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 5:                        # no path: anonymous
                start, end = (int(x, 16) for x in fields[0].split("-"))
                maps.append((start, end, fields[1]))
    tails = {start: end for start, end, perms in maps if perms == "---p"}
    heaps = [start for start, end, perms in maps
             if perms == "rw-p" and start % HEAP == 0 and tails.get(end, end) - start == HEAP]
    owners = set()
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for start in heaps:
            mem.seek(start)
            owners.add(int.from_bytes(mem.read(8), sys.byteorder))
    return len(owners)


async def _stream(session, url: str, rng: random.Random) -> None:
    body = {"prompt": "x" * rng.choice(PROMPT_LENGTHS), "max_tokens": rng.randint(8, 96), "temperature": 0.8,
            "stream": True, "ignore_eos": True, "seed": rng.randrange(2**31)}
    leave = rng.randint(1, 8) if rng.random() < 0.4 else None       # 40% leave after a few chunks
    async with session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"data: {")
            if leave is not None and seen >= leave:
                r.close()
                return


def soak(url: str, pid: int) -> list[float]:
    """The server's resident MiB after each wave, until BUDGET_S has passed."""
    rng = random.Random(0)

    async def main():
        samples, t0 = [], time.monotonic()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(_stream(session, url, rng) for _ in range(PER_WAVE)))   # untimed warm-up
            while time.monotonic() - t0 < BUDGET_S:
                await asyncio.gather(*(_stream(session, url, rng) for _ in range(PER_WAVE)))
                samples.append(vm_rss_mib(pid))
        return samples
    return asyncio.run(main())


@pytest.mark.slow                       # make test-slow: about a minute
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the server's VmRSS from /proc")
def test_a_served_long_run_keeps_the_malloc_arena_cap_and_bounded_growth():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "MINIBATCH_NO_CPP": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SERVER.format(port=port)], env=env, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_started(proc, url)
        samples = soak(url, proc.pid)
        try:
            arenas = malloc_arenas(proc.pid)
        except PermissionError:                 # /proc/PID/mem closed to this user: growth alone
            arenas = None
        assert wait_idle(url) == IDLE
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    print("resident MiB by wave:", [round(s) for s in samples])
    if len(samples) < MIN_WAVES:
        pytest.skip(f"only {len(samples)} waves in {BUDGET_S:.0f} s: too few to see a trend")
    assert arenas is None or arenas <= 1, \
        f"{arenas} malloc arenas besides the main one: the arena cap is not in force"
    half = len(samples) // 2
    growth_kib = (samples[-1] - min(samples[half:])) * 1024
    assert growth_kib <= GROWTH_KIB_PER_STREAM * PER_WAVE * (len(samples) - half), \
        f"resident MiB by wave: {[round(s) for s in samples]}"
