"""The server caps glibc's malloc arenas before its threads start (entrypoints/server/memory.py).

Without the cap a standalone `serve` crept from 426 MB to 910 MB over 4,000
streams and was still rising; with it, it stayed at 586 MB from about 1,500
streams on (book/how_to_run.md, "A long run's memory"). These tests check the
mechanism, not the timing: the cap is set through mallopt on glibc, left alone
when the operator set MALLOC_ARENA_MAX, and set by make_app before the engine
loop's thread exists.
"""
from __future__ import annotations

import platform

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from minibatch_engine.entrypoints.server import launch, memory  # noqa: E402

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="mallopt's arena cap is glibc's")
def test_the_cap_is_set_through_mallopt(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert memory.limit_malloc_arenas(8) is True       # a generous cap: the test leaves the process as it was


def test_an_operators_malloc_arena_max_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert memory.limit_malloc_arenas() is False


def test_make_app_caps_the_arenas_before_the_engine_thread_starts(monkeypatch):
    calls = []
    import threading
    monkeypatch.setattr(launch, "limit_malloc_arenas",
                        lambda: calls.append(threading.active_count()) or True)
    before = threading.active_count()
    launch.make_app("tiny", device="cpu", attention_backend="sdpa")
    assert calls == [before]
