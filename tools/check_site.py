#!/usr/bin/env python3
"""Open every page of the built book in a real browser, offline, and check it.

Usage: python tools/check_site.py [SITE_DIR]   (default: _build/html)
       make check-site                       (builds the book first)

Drives Debian's Chromium (/usr/bin/chromium, or $CHROMIUM) through the Python
``playwright`` package; no browser is downloaded (never ``playwright install``).
Every request that is not file://, data: or blob: is aborted, so a page that
renders here renders with no network.  A page fails when:

* math is left untypeset: raw ``\\(``, ``\\[`` or ``$$`` in the visible text
  (code excluded) once MathJax's startup promise has settled, a Sphinx math
  element that MathJax did not replace, or a MathJax error box (merror);
* an image does not load (naturalWidth == 0) or a local file request fails;
* an internal link points to a missing file or a missing anchor id;
* a widget view (``application/vnd.jupyter.widget-view+json``) or a
  ``.jupyter-widgets`` element is still empty after the widget manager ran,
  or the page loads the widget manager (``embed-amd.js``) and shows no widget;
* a progress bar shows: a rendered widget bar (``.widget-hprogress`` or
  ``progress``) or tqdm's text bar in a cell output, not hidden by the
  ``hide-progress`` tag;
* the page logs a JavaScript error (console error or uncaught exception), or
  tries to reach the network at all;
* code is clipped at a 1280 px window: a code cell's source or output, or a
  listing, is wider than its box (``scrollWidth > clientWidth`` of a ``pre``,
  ``div.highlight`` or cell output area, collapsed cells opened first);
* a display formula is wider than the article at 1280 px;
* a reference page (:data:`REFERENCE_PAGES`) on a 390 px phone is wider than
  the screen, cuts content (an element wider than a box that hides overflow),
  has a prose table that scrolls sideways, or a formula that scrolls with no
  cue; or, printed (A4, print stylesheet), cuts content or takes more sheets
  than :data:`PRINT_PAGES` allows.

Screenshots of the landing page and of every chapter go to
``_build/screenshots/`` (full page, height capped).  Prints one row per page
and exits non-zero with a message per problem when anything fails.
"""

from __future__ import annotations

import argparse
import asyncio
import html.parser
import json
import os
import re
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from check_explorables import check_explorables, summary  # the explorables' controls and numbers
from headless import CHROMIUM_ARGS, LOCAL, PHONE, VIEWPORT, offline

SCREENSHOT_MAX_HEIGHT = 16000  # px (Chromium paints at most 16384); longer pages are cut
LOAD_TIMEOUT_MS = 20_000
SETTLE_TIMEOUT_S = 15.0  # MathJax + widget manager, per page
CONCURRENCY = min(4, os.cpu_count() or 2)  # pages open at once

# The pages a reader keeps at hand: checked on a phone and in print as well,
# with the most printed pages (both sides of a sheet: 2) where one is set.
REFERENCE_PAGES = {"book/cheat_sheet.html": 2, "book/interview_guide.html": None,
                   "book/glossary.html": None}

# Pages left out.  None today: search.html and genindex.html load fine from
# file:// (search.html pulls searchindex.js through a <script> tag, which
# file:// allows) and are checked like the rest.
SKIP_PAGES: set[str] = set()

# Runs inside the page once it has loaded: waits for MathJax and the widget
# manager, then reports what it finds.
PAGE_PROBE = r"""
async (settleMs) => {
  const deadline = Date.now() + settleMs;
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const out = {mathjax: null, raw_math: [], untypeset: 0, merror: [],
               images: [], widget_views: 0, widget_problems: [], ids: [],
               links: [], timeouts: [], progress: []};

  // --- MathJax: the real MathJax replaces the config object Sphinx sets.
  const mathEls = document.querySelectorAll("span.math, div.math");
  const hasMathJaxScript = !!document.querySelector('script[src*="mathjax"]');
  if (hasMathJaxScript) {
    while (!(window.MathJax && MathJax.startup && MathJax.startup.promise)
           && Date.now() < deadline) await sleep(50);
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      await Promise.race([MathJax.startup.promise, sleep(Math.max(0, deadline - Date.now()))]);
      out.mathjax = MathJax.version || "?";
    } else {
      out.timeouts.push("MathJax never started (script failed to load?)");
    }
  }
  // --- Widgets: the manager puts a .widget-subarea before each view script.
  const views = document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]');
  out.widget_views = views.length;
  if (!views.length && document.querySelector('script[src*="embed-amd.js"]')) {
    out.widget_problems.push("loads the widget manager (embed-amd.js) but shows no widget");
  }
  const rendered = (v) => {
    const sub = v.previousElementSibling;
    if (!(sub && sub.classList.contains("widget-subarea") && sub.querySelector("*"))) return false;
    // a widget in a collapsed (hidden) output has no size: children suffice
    return sub.getClientRects().length === 0 || sub.getBoundingClientRect().height > 0;
  };
  while (Array.from(views).some((v) => !rendered(v)) && Date.now() < deadline) await sleep(50);
  views.forEach((v, i) => {
    if (!rendered(v)) {
      let id = "?";
      try { id = JSON.parse(v.textContent).model_id; } catch (e) {}
      out.widget_problems.push(`widget view #${i + 1} (model ${id}) not rendered`);
    }
  });
  // A rendered widget's root is a non-empty .jupyter-widgets element (an
  // Output widget may legitimately hold nothing).
  for (const el of document.querySelectorAll(".jupyter-widgets")) {
    if (!el.matches(".widget-output, .jupyter-widgets-output-area") && el.childElementCount === 0
        && el.textContent.trim() === "") {
      out.widget_problems.push(`empty .jupyter-widgets element (${el.className})`);
    }
  }

  // Progress bars (tqdm) only say how long a cell once took: a cell tagged
  // `hide-progress` hides them (book/site/book.css). One still drawn is a
  // cell that lacks the tag: a widget bar, or tqdm's text bar in an output.
  const shown = (el) => el.getClientRects().length > 0;
  const barText = (el) => {
    const box = el.closest(".widget-hbox, .widget-subarea") || el;
    return (box.textContent || "").trim().replace(/\s+/g, " ").slice(0, 60);
  };
  for (const el of document.querySelectorAll(".widget-hprogress, .widget-vprogress, progress")) {
    if (shown(el)) out.progress.push(barText(el));
  }
  const textBar = /\d+%\|[^|\n]*\|\s*\d+\/\d+|\[\d+:\d\d<\d+:\d\d/;
  for (const el of document.querySelectorAll(".cell_output pre, .cell_output .output_text")) {
    const m = (el.textContent || "").match(textBar);
    if (m && shown(el)) out.progress.push(m[0].slice(0, 60));
  }

  // Widget labels are typeset after startup (MathJax.Hub shim in
  // book/site/widgets-setup.js chains onto startup.promise): wait again.
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await Promise.race([MathJax.startup.promise, sleep(Math.max(0, deadline - Date.now()))]);
  }
  out.math_elements = mathEls.length;
  for (const el of mathEls) {
    if (!el.querySelector("mjx-container")) out.untypeset++;
  }
  for (const el of document.querySelectorAll("mjx-merror")) {
    const box = el.closest("[data-mjx-error]");
    out.merror.push(((box && box.getAttribute("data-mjx-error")) || el.textContent).slice(0, 120));
  }
  // raw TeX left in visible text, code and MathJax's own output excluded
  const skip = "pre, code, script, style, textarea, kbd, samp, .highlight, mjx-container, mjx-assistive-mml";
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const t = n.nodeValue;
    if (!t || !(t.includes("\\(") || t.includes("\\[") || t.includes("$$"))) continue;
    const p = n.parentElement;
    if (!p || p.closest(skip)) continue;
    if (p.getClientRects().length === 0) continue;  // not rendered (display: none)
    out.raw_math.push(t.trim().slice(0, 80));
  }

  // --- Images: make lazy ones load, then wait for all of them.
  const imgs = Array.from(document.images);
  imgs.forEach((im) => { if (im.loading === "lazy") im.loading = "eager"; });
  await Promise.race([
    Promise.all(imgs.map((im) => im.complete ? null :
      new Promise((r) => { im.addEventListener("load", r); im.addEventListener("error", r); }))),
    sleep(Math.max(0, deadline - Date.now())),
  ]);
  for (const im of imgs) {
    out.images.push({src: im.currentSrc || im.src, raw: im.getAttribute("src"),
                     ok: im.complete && im.naturalWidth > 0});
  }

  // --- Anchors present in the live DOM, and every link.
  for (const el of document.querySelectorAll("[id]")) out.ids.push(el.id);
  for (const el of document.querySelectorAll("a[name]")) out.ids.push(el.getAttribute("name"));
  for (const a of document.querySelectorAll("a[href]")) {
    out.links.push({href: a.href, raw: a.getAttribute("href")});
  }
  return out;
}
"""


# Runs after the screenshot: opens every collapsed block (hide-input cells,
# dropdowns) so hidden code is measured too, then lists each code box whose
# content is wider than the box itself (it would scroll or be clipped).
OVERFLOW_PROBE = r"""
() => {
  document.querySelectorAll("details").forEach((d) => { d.open = true; });
  const boxes = ".bd-article pre, .bd-article div.highlight, .bd-article .cell_output, "
              + ".bd-article .cell_output .output, .bd-article .cell_output .pst-scrollable-table-container";
  const out = [];
  const seen = new Set();
  for (const el of document.querySelectorAll(boxes)) {
    if (el.getClientRects().length === 0) continue;  // not rendered
    const over = el.scrollWidth - el.clientWidth;
    if (over <= 1) continue;  // 1 px: sub-pixel rounding
    // report the innermost box once (a pre inside its div.highlight overflows both)
    const inner = el.querySelector("pre") && el.querySelector("pre").scrollWidth - el.querySelector("pre").clientWidth > 1
      ? el.querySelector("pre") : el;
    if (seen.has(inner)) continue;
    seen.add(inner);
    const where = inner.closest(".cell_output") ? "cell output"
                : inner.closest(".cell_input") ? "cell source" : "listing";
    const lines = (inner.textContent || "").split("\n");
    const widest = lines.reduce((a, b) => (b.length > a.length ? b : a), "");
    out.push({where, over, width: inner.clientWidth, columns: widest.length,
              snippet: widest.trim().slice(0, 70)});
  }
  return out;
}
"""


# Display formulas wider than their box (at 1280 px none may be: they fit).
MATH_PROBE = r"""
() => Array.from(document.querySelectorAll(".bd-article div.math"))
  .filter((el) => el.getClientRects().length && el.scrollWidth - el.clientWidth > 1)
  .map((el) => ({over: el.scrollWidth - el.clientWidth, width: el.clientWidth,
                 snippet: (el.textContent || "").trim().slice(0, 50)}))
"""

# On a phone or in print: what is cut, runs off the page, or scrolls sideways.
NARROW_PROBE = r"""
async () => {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await Promise.race([MathJax.startup.promise, sleep(10000)]);
  }
  document.querySelectorAll("details").forEach((d) => { d.open = true; });
  await sleep(200);
  const out = [];
  const vw = document.documentElement.clientWidth;
  const page = document.documentElement.scrollWidth;
  const text = (el) => (el.textContent || "").trim().replace(/\s+/g, " ").slice(0, 60);
  if (page > vw + 1) {
    // the innermost visible element that sticks out the most (MathJax's
    // assistive MathML is clipped to nothing: it widens the page but shows nothing)
    let worst = null, right = vw + 1;
    for (const el of document.body.querySelectorAll("*")) {
      const r = el.getBoundingClientRect();
      if (r.width && r.right > right - 0.5 && !el.closest("mjx-container *, mjx-assistive-mml")
          && getComputedStyle(el).visibility !== "hidden") { worst = el; right = r.right; }
    }
    if (worst) {
      out.push(`the page is ${Math.round(right)} px wide, wider than the ${vw} px screen `
               + `(${worst.tagName.toLowerCase()}.${worst.className}: ${JSON.stringify(text(worst))})`);
    }
  }
  const article = document.querySelector(".bd-article") || document.body;
  for (const el of article.querySelectorAll("*")) {
    if (!el.getClientRects().length) continue;
    const over = el.scrollWidth - el.clientWidth;
    if (over <= 1 || el.clientWidth === 0) continue;
    const cs = getComputedStyle(el);
    const scrolls = cs.overflowX === "auto" || cs.overflowX === "scroll";
    const hides = cs.overflowX === "hidden" || cs.overflowX === "clip";
    if (el.closest(".cell_output, .cell_input, pre, .highlight")) continue;  // code: the 1280 px check
    if (hides && !el.matches("mjx-container *, mjx-container")) {
      out.push(`cut: ${el.tagName.toLowerCase()}.${el.className} is ${over} px wider than its box: ${JSON.stringify(text(el))}`);
    } else if (scrolls && el.matches("div.math, span.math")) {
      const cue = cs.backgroundImage.includes("gradient");
      if (!cue) out.push(`a formula scrolls sideways with no cue: ${JSON.stringify(text(el))}`);
    } else if (scrolls && el.querySelector("table")) {
      out.push(`a table scrolls sideways (${over} px): ${JSON.stringify(text(el))}`);
    }
  }
  return out;
}
"""


def pdf_pages(pdf: bytes) -> int:
    """Pages in a PDF Chromium printed (its page objects)."""
    return len(re.findall(rb"/Type\s*/Page[^s]", pdf))


class _IdCollector(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if v and (k == "id" or (k == "name" and tag == "a")):
                self.ids.add(v)


_ID_CACHE: dict[Path, set[str]] = {}


def ids_in(path: Path) -> set[str]:
    if path not in _ID_CACHE:
        p = _IdCollector()
        p.feed(path.read_text(encoding="utf-8", errors="replace"))
        _ID_CACHE[path] = p.ids
    return _ID_CACHE[path]


@dataclass
class PageResult:
    rel: str
    problems: list[str] = field(default_factory=list)
    math: int = 0
    images: int = 0
    widgets: int = 0
    links: int = 0
    seconds: float = 0.0
    screenshot: str = ""


def check_links(page: Path, site: Path, links: list[dict], live_ids: set[str]) -> tuple[int, list[str]]:
    problems, checked, seen = [], 0, set()
    for link in links:
        url = urllib.parse.urlsplit(link["href"])
        if url.scheme != "file":
            continue  # external links are not followed (no network)
        target = Path(urllib.parse.unquote(url.path))
        key = (target, url.fragment)
        if key in seen:
            continue
        seen.add(key)
        checked += 1
        raw = link["raw"]
        try:
            target.relative_to(site)
        except ValueError:
            problems.append(f"link {raw!r} leaves the site ({target})")
            continue
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            problems.append(f"link {raw!r}: missing file {target.relative_to(site)}")
            continue
        frag = urllib.parse.unquote(url.fragment)
        if not frag or target.suffix != ".html":
            continue
        ids = live_ids if target == page else ids_in(target)
        if frag not in ids:
            problems.append(f"link {raw!r}: no id {frag!r} in {target.relative_to(site)}")
    return checked, problems


async def check_page(browser, site: Path, page_path: Path, shots: Path | None) -> PageResult:
    rel = page_path.relative_to(site).as_posix()
    res = PageResult(rel)
    t0 = time.perf_counter()
    ctx = await browser.new_context(viewport=VIEWPORT, service_workers="block")
    page = await ctx.new_page()
    errors: list[str] = []
    failed_files: list[str] = []

    async def route(r):
        url = r.request.url
        if url.startswith(LOCAL):
            await r.continue_()
        else:
            res.problems.append(f"network request blocked: {url}")
            await r.abort("blockedbyclient")

    await page.route("**/*", route)

    def on_pageerror(exc):
        # first stack frame that names a file, for "where"
        frames = re.findall(r"\((?:file://)?([^()]+?):(\d+):\d+\)", getattr(exc, "stack", "") or "")
        where = f" ({Path(frames[0][0].split('?')[0]).name}:{frames[0][1]})" if frames else ""
        errors.append(f"uncaught JS exception: {exc.message if hasattr(exc, 'message') else exc}{where}")

    page.on("pageerror", on_pageerror)

    def on_console(msg):
        # "Failed to load resource" repeats a failed request, which is
        # reported with its URL (requestfailed below, or the route above)
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            loc = msg.location or {}
            where = f" ({loc.get('url', '').rsplit('/', 1)[-1]}:{loc.get('lineNumber', '?')})" if loc.get("url") else ""
            errors.append(f"console error: {msg.text[:300]}{where}")

    page.on("console", on_console)

    def on_failed(req):
        if req.url.startswith("file:"):
            failed_files.append(f"failed to load {urllib.parse.unquote(req.url[len('file://'):])}: {req.failure}")

    page.on("requestfailed", on_failed)

    redirect = meta_refresh_target(page_path)
    if redirect is not None:
        # index.html is Jupyter Book's <meta http-equiv="Refresh"> to the root
        # page: loading it navigates away mid-probe.  Check its target exists;
        # the target is checked (and screenshotted) as a page of its own.
        await ctx.close()
        target = (page_path.parent / redirect.split("#")[0]).resolve()
        res.links = 1
        if not target.is_file():
            res.problems.append(f"redirects to missing {redirect!r}")
        res.seconds = time.perf_counter() - t0
        return res

    try:
        await page.goto(page_path.as_uri(), wait_until="load", timeout=LOAD_TIMEOUT_MS)
        probe = await page.evaluate(PAGE_PROBE, int(SETTLE_TIMEOUT_S * 1000))
    except Exception as exc:  # noqa: BLE001 - report any browser failure per page
        res.problems.append(f"could not load/probe the page: {exc}")
        await ctx.close()
        res.seconds = time.perf_counter() - t0
        return res

    res.math = probe["math_elements"]
    res.widgets = probe["widget_views"]
    res.images = len(probe["images"])
    res.problems += probe["timeouts"]
    if probe["untypeset"]:
        res.problems.append(f"{probe['untypeset']} of {res.math} math elements not typeset by MathJax")
    for t in probe["raw_math"]:
        res.problems.append(f"raw TeX in visible text: {t!r}")
    for t in probe["merror"]:
        res.problems.append(f"MathJax error: {t!r}")
    for im in probe["images"]:
        if not im["ok"]:
            res.problems.append(f"image did not load: {im['raw']}")
    res.problems += probe["widget_problems"]
    for t in probe["progress"]:
        res.problems.append(f"a progress bar shows (tag its cell hide-progress): {t!r}")
    res.links, link_problems = check_links(page_path, site, probe["links"], set(probe["ids"]))
    res.problems += link_problems

    if shots is not None:
        name = rel.removesuffix(".html").replace("/", "__") + ".png"
        height = await page.evaluate("document.documentElement.scrollHeight")
        clip = {"x": 0, "y": 0, "width": VIEWPORT["width"], "height": min(height, SCREENSHOT_MAX_HEIGHT)}
        await page.screenshot(path=str(shots / name), full_page=True, clip=clip)
        res.screenshot = str((shots / name))
    try:
        for o in await page.evaluate(OVERFLOW_PROBE):
            res.problems.append(
                f"code wider than its box at {VIEWPORT['width']} px ({o['where']}, "
                f"{o['columns']} columns, {o['over']} px past a {o['width']} px box): {o['snippet']!r}")
    except Exception as exc:  # noqa: BLE001 - report, don't crash the run
        res.problems.append(f"could not measure code widths: {exc}")
    try:
        for o in await page.evaluate(MATH_PROBE):
            res.problems.append(f"formula wider than its box at {VIEWPORT['width']} px "
                                f"({o['over']} px past a {o['width']} px box): {o['snippet']!r}")
    except Exception as exc:  # noqa: BLE001
        res.problems.append(f"could not measure formula widths: {exc}")
    try:
        res.problems += (await check_explorables(page, shots))[1]
    except Exception as exc:  # noqa: BLE001 - report, don't crash the run
        res.problems.append(f"could not check the explorables: {exc}")
    # late failures: web fonts load when first drawn (after the probe, and
    # the screenshot draws the whole page)
    try:
        await page.evaluate("document.fonts.ready.then(() => true)")
        await page.wait_for_timeout(100)
    except Exception:  # noqa: BLE001 - a busy page is not a failure by itself
        pass
    res.problems += failed_files
    res.problems += errors
    await ctx.close()
    res.seconds = time.perf_counter() - t0
    return res


async def check_narrow(browser, site: Path, page_path: Path, max_pages: int | None) -> list[str]:
    """A reference page on a 390 px phone and printed on A4 (see NARROW_PROBE)."""
    problems: list[str] = []
    ctx = await browser.new_context(viewport=PHONE, device_scale_factor=1, service_workers="block")
    page = await ctx.new_page()
    await page.route("**/*", offline)
    try:
        await page.goto(page_path.as_uri(), wait_until="load", timeout=LOAD_TIMEOUT_MS)
        problems += [f"phone ({PHONE['width']} px): {m}" for m in await page.evaluate(NARROW_PROBE)]
        await page.set_viewport_size({"width": 718, "height": 1000})   # A4 less 12 mm margins, 96 dpi
        await page.emulate_media(media="print")
        problems += [f"print: {m}" for m in await page.evaluate(NARROW_PROBE)]
        pdf = await page.pdf(format="A4", print_background=False, prefer_css_page_size=True)
        n = pdf_pages(pdf)
        if max_pages is not None and n > max_pages:
            problems.append(f"print: {n} A4 pages, more than {max_pages}")
    except Exception as exc:  # noqa: BLE001 - report any browser failure per page
        problems.append(f"could not check it on a phone or in print: {exc}")
    await ctx.close()
    return problems


CDN_RE = re.compile(r"cdn\.jsdelivr|unpkg\.com|cdnjs|cdn\.plot\.ly|fonts\.googleapis", re.I)


def cdn_references(site: Path) -> dict[str, list[str]]:
    """Every CDN host named anywhere in a built HTML page (scripts, links, text)."""
    found = {}
    for p in built_pages(site, quiet=True):
        hits = sorted({m.group(0) for m in CDN_RE.finditer(p.read_text(encoding="utf-8", errors="replace"))})
        if hits:
            found[p.relative_to(site).as_posix()] = hits
    return found


_REFRESH = re.compile(r"""<meta\s+http-equiv=["']?refresh["']?\s+content=["']\s*\d+\s*;\s*url=([^"'>]+)""", re.I)


def meta_refresh_target(path: Path) -> str | None:
    head = path.read_text(encoding="utf-8", errors="replace")[:4096]
    m = _REFRESH.search(head)
    return m.group(1).strip() if m else None


SPECIAL_PAGES = {"index", "genindex", "search", "py-modindex"}  # not documents


def built_pages(site: Path, quiet: bool = False) -> list[Path]:
    """The HTML pages of the latest build.

    Sphinx leaves the pages of deleted (or newly excluded) documents in
    _build/html; the docnames in searchindex.js are the current documents.
    """
    pages = sorted(p for p in site.rglob("*.html")
                   if not p.relative_to(site).parts[0].startswith("_")  # _static, _sources, _images
                   and p.relative_to(site).as_posix() not in SKIP_PAGES)
    index = site / "searchindex.js"
    m = re.search(r'"docnames":\s*(\[[^\]]*\])', index.read_text(encoding="utf-8")) if index.exists() else None
    if not m:
        return pages
    docnames = set(json.loads(m.group(1))) | SPECIAL_PAGES
    stale = [p for p in pages if p.relative_to(site).with_suffix("").as_posix() not in docnames]
    if stale and not quiet:
        print("skipped, left over from earlier builds: " + ", ".join(p.relative_to(site).as_posix() for p in stale))
    return [p for p in pages if p not in stale]


def root_page(site: Path) -> str:
    """The landing page: what index.html redirects to (Jupyter Book's root)."""
    target = meta_refresh_target(site / "index.html")
    if target is None:
        return "index.html"
    return (site / target.split("#")[0]).resolve().relative_to(site).as_posix()


async def run(site: Path, shots: Path, chromium: str, jobs: int,
              only: list[str] | None = None) -> list[PageResult]:
    from playwright.async_api import async_playwright

    pages = built_pages(site)
    if only:
        pages = [p for p in pages if p.relative_to(site).as_posix() in only]
    shots.mkdir(parents=True, exist_ok=True)
    for old in shots.glob("*.png"):
        old.unlink()
    root = root_page(site)

    def wants_screenshot(rel: str) -> bool:  # the landing page and every chapter
        return rel == root or rel.startswith("chapters/")
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        sem = asyncio.Semaphore(jobs)

        async def one(path: Path) -> PageResult:
            async with sem:
                rel = path.relative_to(site).as_posix()
                res = await check_page(browser, site, path, shots if wants_screenshot(rel) else None)
                if rel in REFERENCE_PAGES:
                    res.problems += await check_narrow(browser, site, path, REFERENCE_PAGES[rel])
                return res

        results = await asyncio.gather(*(one(p) for p in pages))
        await browser.close()
    return list(results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", nargs="?", default="_build/html", help="built HTML folder (default: _build/html)")
    ap.add_argument("--screenshots", default=None, help="where PNGs go (default: SITE/../screenshots)")
    ap.add_argument("--jobs", type=int, default=CONCURRENCY, help="pages checked at once")
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    ap.add_argument("--only", nargs="+", metavar="PAGE", help="check only these pages (paths under SITE)")
    args = ap.parse_args(argv)

    site = Path(args.site).resolve()
    shots = Path(args.screenshots).resolve() if args.screenshots else site.parent / "screenshots"
    if not (site / "index.html").exists():
        print(f"check-site: no {site}/index.html: build the book first (make build)", file=sys.stderr)
        return 2
    if not Path(args.chromium).exists():
        print(f"check-site: no browser at {args.chromium} (apt-get install -y chromium)", file=sys.stderr)
        return 2
    try:
        import playwright  # noqa: F401
    except ImportError:
        print("check-site: the Python package `playwright` is missing: pip install -e '.[book]'", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    results = asyncio.run(run(site, shots, args.chromium, max(1, args.jobs), args.only))
    total = time.perf_counter() - t0

    # static check: no CDN named in any built HTML file
    for rel, hits in cdn_references(site).items():
        if args.only and rel not in args.only:
            continue
        r = next((r for r in results if r.rel == rel), None)
        if r is None:  # an HTML file that was not opened (under _static/ or the like)
            r = PageResult(rel)
            results.append(r)
        r.problems.append(f"references a CDN in its HTML: {', '.join(hits)}")

    w = max(len(r.rel) for r in results)
    print(f"{'page':<{w}}  {'math':>4}  {'img':>3}  {'widg':>4}  {'links':>5}  {'time':>5}  result")
    for r in results:
        status = "ok" if not r.problems else f"FAIL ({len(r.problems)})"
        print(f"{r.rel:<{w}}  {r.math:>4}  {r.images:>3}  {r.widgets:>4}  {r.links:>5}  {r.seconds:>4.1f}s  {status}")
    failed = [r for r in results if r.problems]
    for r in failed:
        print(f"\n{r.rel}:")
        for msg in r.problems:
            print(f"  - {msg}")
    n_shots = sum(1 for r in results if r.screenshot)
    print(f"\n{len(results)} pages, {len(failed)} failed, {total:.1f}s; {n_shots} screenshots in {shots}")
    print(summary(shots))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
