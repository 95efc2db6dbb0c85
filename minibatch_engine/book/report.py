"""Small helpers that turn results into tables for the notebooks."""
from __future__ import annotations

from typing import Sequence


class Table:
    """A table that renders as Markdown in notebooks and the book, and as
    aligned text elsewhere (the text form is what nbval compares)."""

    def __init__(self, rows: Sequence[Sequence], headers: Sequence[str], floatfmt: str = ".3f"):
        self.headers = list(headers)
        self.rows = [[self._fmt(v, floatfmt) for v in row] for row in rows]

    @staticmethod
    def _fmt(v, floatfmt):
        if isinstance(v, float):
            return format(v, floatfmt)
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    def _repr_markdown_(self) -> str:
        head = "| " + " | ".join(self.headers) + " |"
        sep = "|" + "|".join("---" for _ in self.headers) + "|"
        body = ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join([head, sep, *body])

    def __repr__(self) -> str:
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) for i, h in enumerate(self.headers)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        return "\n".join([line(self.headers), *(line(r) for r in self.rows)])
