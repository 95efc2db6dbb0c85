#!/usr/bin/env python3
"""Operate every explorable on a page (minibatch_engine/book/explorables) and check it.

Called by tools/check_site.py for every page it opens; also runs alone on any
HTML files:  python tools/check_explorables.py PAGE.html ... [--screenshots DIR]

A chapter of ``EXPECTED`` without its explorable fails. For each
``.mbe-explorable`` on the page, a problem is reported when:

* it did not mount (its script did not run, or threw);
* a control has no label, or is not a native range/select (keyboard-operable);
* moving a control (each in turn, to another value) leaves what the
  explorable shows unchanged;
* a range control does not move with the keyboard (ArrowRight/ArrowLeft),
  or its shown value does not follow;
* at a setting listed in its ``data-checks`` (computed in Python by the
  chapter's own functions), a number it shows (``data-value``) differs from
  the chapter's;
* it is wider than its box at a 390 px phone width.

Screenshots of each explorable, at 1280 and 390 px, light and dark, go to
``SHOTS/explorables/NAME-WIDTH-THEME.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from headless import CHROMIUM_ARGS, PHONE, VIEWPORT, offline

REL_TOL = 1e-5   # the expected figures are stored to 6 significant digits

# Inside the page: every explorable's state, controls and outputs.
STATE = r"""
(root) => {
  const view = root.querySelector(".mbe-view");
  const outs = {};
  root.querySelectorAll("[data-out]").forEach((o) => { outs[o.getAttribute("data-out")] = o.getAttribute("data-value"); });
  return {shown: (view ? view.innerHTML : root.innerHTML), outs};
}
"""
CONTROLS = r"""
(root) => Array.from(root.querySelectorAll("input, select")).map((c) => {
  const label = c.id ? root.querySelector(`label[for="${c.id}"]`) : null;
  return {name: c.name, id: c.id, tag: c.tagName.toLowerCase(), type: c.type || "",
          label: label ? label.textContent.trim() : "",
          value: c.value, min: c.min, max: c.max,
          options: c.tagName === "SELECT" ? Array.from(c.options).map((o) => o.value) : []};
})
"""
SET = r"""
([root, name, value]) => {
  const c = root.querySelector(`[name="${name}"]`);
  if (!c) return false;
  c.value = String(value);
  c.dispatchEvent(new Event("input", {bubbles: true}));
  c.dispatchEvent(new Event("change", {bubbles: true}));
  return c.value === String(value);
}
"""


def _other(c: dict) -> str:
    """A value of control ``c`` other than its current one."""
    if c["tag"] == "select":
        return next(v for v in c["options"] if v != c["value"])
    return c["min"] if c["value"] != c["min"] else c["max"]


def _close(got: str | None, want: float) -> bool:
    try:
        x = float(got)
    except (TypeError, ValueError):
        return False
    if want is None or (isinstance(want, float) and math.isnan(want)):
        return math.isnan(x)
    return math.isclose(x, want, rel_tol=REL_TOL, abs_tol=1e-9)


CHECKED: list[str] = []   # every explorable checked in this process, for summary()

#: the explorables each chapter must show (issue 31): a chapter executed
#: without its explorable's output fails the check
EXPECTED = {
    "02_static_batching.html": {"ch2-eta"},
    "03_continuous_batching.html": {"ch3-steps"},
    "04_paged_attention.html": {"ch4-blocks"},
    "05_chunked_prefill.html": {"ch5-budget"},
    "06_preemption.html": {"ch6-preemption"},
    "07_scheduling_policies.html": {"ch7-policies"},
    "08_serving_under_load.html": {"ch8-load"},
    "13_fewer_bytes.html": {"ch13-memory"},
    "14_big_models.html": {"ch14-deploy"},
}


def summary(shots: Path | None = None) -> str:
    """One line: the explorables checked, and where their screenshots are."""
    where = f"; screenshots in {shots / 'explorables'}" if shots is not None and CHECKED else ""
    return f"{len(CHECKED)} explorables operated and checked ({', '.join(CHECKED) or 'none'}){where}"


async def check_explorables(page, shots: Path | None = None) -> tuple[int, list[str]]:
    """Check every explorable on an open page; returns (how many, problems)."""
    roots = await page.query_selector_all(".mbe-explorable")
    problems: list[str] = []
    for root in roots:
        name = await root.get_attribute("id") or "?"
        CHECKED.append(name.removeprefix("mbe-"))
        if not await root.get_attribute("data-mounted"):
            problems.append(f"explorable {name}: did not mount (its script did not run)")
            continue
        controls = await root.evaluate(CONTROLS)
        if not controls:
            problems.append(f"explorable {name}: has no control")
        for c in controls:
            where = f"explorable {name}, control {c['name']!r}"
            if not c["label"]:
                problems.append(f"{where}: no <label for=...>")
            if not (c["tag"] == "select" or c["type"] == "range"):
                problems.append(f"{where}: a {c['tag']} {c['type']} (use a range or a select)")
                continue
            before = await root.evaluate(STATE)
            await page.evaluate(SET, [root, c["name"], _other(c)])
            after = await root.evaluate(STATE)
            if after == before:
                problems.append(f"{where}: moving it to {_other(c)!r} changed nothing shown")
            await page.evaluate(SET, [root, c["name"], c["value"]])
            if await root.evaluate(STATE) != before:
                problems.append(f"{where}: moving it back to {c['value']!r} did not restore the view")
            if c["type"] == "range":
                handle = await root.query_selector(f'[name="{c["name"]}"]')
                key = "ArrowLeft" if c["value"] == c["max"] else "ArrowRight"
                label = "(e) => (e.parentElement.querySelector('output') || {}).textContent"
                shown = await handle.evaluate(label)
                await handle.focus()
                await page.keyboard.press(key)
                moved = await handle.evaluate("(e) => e.value")
                if moved == c["value"] or await handle.evaluate(label) == shown:
                    problems.append(f"{where}: {key} did not move it (or its shown value)")
                await page.evaluate(SET, [root, c["name"], c["value"]])
        checks = json.loads(await root.get_attribute("data-checks") or "[]")
        for chk in checks:
            for ctl, value in chk["set"].items():
                if not await page.evaluate(SET, [root, ctl, value]):
                    problems.append(f"explorable {name}: cannot set {ctl} to {value!r}")
            state = await root.evaluate(STATE)
            for key, want in chk["expect"].items():
                got = state["outs"].get(key)
                if not _close(got, want):
                    problems.append(f"explorable {name} at {chk['set']}: {key} shows {got}, "
                                    f"the chapter computed {want}")
        for c in controls:  # back to the starting setting
            await page.evaluate(SET, [root, c["name"], c["value"]])
    found = {((await r.get_attribute("id")) or "").removeprefix("mbe-") for r in roots}
    missing = EXPECTED.get(page.url.split("?")[0].split("#")[0].rsplit("/", 1)[-1], set()) - found
    if missing:
        problems.append(f"no explorable {', '.join(sorted(missing))} on this page (its cell has no output?)")
    if roots:
        problems += await _views(page, roots, shots)
    return len(roots), problems


async def _views(page, roots, shots: Path | None) -> list[str]:
    """Screenshots at desktop and phone width, light and dark; the phone-width fit."""
    problems = []
    size = page.viewport_size
    await page.evaluate("() => document.activeElement && document.activeElement.blur()")
    folder = None
    if shots is not None:
        folder = shots / "explorables"
        folder.mkdir(parents=True, exist_ok=True)
    for width in (size, PHONE):
        await page.set_viewport_size(width)
        for theme in ("light", "dark"):
            await page.evaluate("(t) => document.documentElement.setAttribute('data-theme', t)", theme)
            await page.wait_for_timeout(50)
            for root in roots:
                name = (await root.get_attribute("id") or "x").removeprefix("mbe-")
                if width is PHONE and theme == "light":
                    over = await root.evaluate("(r) => r.scrollWidth - r.clientWidth")
                    if over > 1:
                        problems.append(f"explorable {name}: {over} px wider than its box at 390 px")
                if folder is not None:
                    await root.scroll_into_view_if_needed()
                    await root.screenshot(path=str(folder / f"{name}-{width['width']}-{theme}.png"))
    await page.set_viewport_size(size)
    await page.evaluate("() => document.documentElement.setAttribute('data-theme', 'light')")
    return problems


async def _main(pages: list[Path], shots: Path | None, chromium: str) -> int:
    from playwright.async_api import async_playwright
    failed = 0
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        for path in pages:
            ctx = await browser.new_context(viewport=VIEWPORT)
            page = await ctx.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(f"uncaught JS exception: {e}"))
            await page.route("**/*", offline)
            await page.goto(path.resolve().as_uri(), wait_until="load")
            n, problems = await check_explorables(page, shots)
            problems += errors
            print(f"{path}: {n} explorables, {'ok' if not problems else 'FAIL'}")
            for msg in problems:
                print(f"  - {msg}")
            failed += bool(problems)
            await ctx.close()
        await browser.close()
    return 1 if failed else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--screenshots", type=Path, default=None)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    a = ap.parse_args()
    sys.exit(asyncio.run(_main(a.pages, a.screenshots, a.chromium)))
