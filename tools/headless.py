"""The headless Chromium every browser check of the book drives
(tools/check_site.py, tools/check_explorables.py, tools/check_lab.py):
Debian's browser through the Python ``playwright`` package, with no network.

Its flags, the two window sizes the checks measure at (a 1280 px desktop and a
390 px phone), and the route handler that keeps a page offline.
"""
from __future__ import annotations

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}   # an iPhone 12-15's CSS pixels
LOCAL = ("file:", "data:", "blob:")


def offline(route):
    """A ``page.route`` handler: local URLs load, every other request is aborted.
    Returns what playwright's call returns (a coroutine in the async API)."""
    if route.request.url.startswith(LOCAL):
        return route.continue_()
    return route.abort("blockedbyclient")
