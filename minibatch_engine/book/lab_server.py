"""``BookContentsManager``: JupyterLab's file access with the chapters made
readable (see :mod:`minibatch_engine.book.lab`). ``make lab`` starts Lab with
``--ServerApp.contents_manager_class=minibatch_engine.book.lab_server.BookContentsManager``.

Opening a notebook gives Lab :func:`~minibatch_engine.book.lab.for_lab`'s copy
(glued numbers filled in); saving writes :func:`~minibatch_engine.book.lab.from_lab`'s
(the source as committed), so opening and saving a chapter leaves its file as
it was. Needs ``jupyter_server`` (the ``lab`` extra).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

from .lab import for_lab, from_lab

BIB = Path(__file__).resolve().parents[2] / "book" / "references.bib"


class BookContentsManager(AsyncLargeFileManager):
    """The default contents manager, plus the book's rendering of notebooks."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if content and model.get("type") == "notebook" and model.get("content") is not None:
            where = Path(self._get_os_path(path)).parent
            model["content"] = nbformat.from_dict(
                for_lab(model["content"], where=where, bib=BIB if BIB.exists() else None))
        return model

    async def save(self, model, path=""):
        if model.get("type") == "notebook" and model.get("content") is not None:
            model = dict(model, content=from_lab(model["content"]))
            if self._same_as_on_disk(model["content"], path):
                # JSON through the browser turns 2.0 into 2 (widget state):
                # an unchanged notebook is not rewritten at all
                return await super().get(path, content=False)
        return await super().save(model, path)

    def _same_as_on_disk(self, content, path) -> bool:
        os_path = Path(self._get_os_path(path.strip("/")))
        if not os_path.is_file():
            return False
        try:
            on_disk = nbformat.reads(os_path.read_text(encoding="utf-8"), as_version=4)
        except Exception:
            return False
        mine = nbformat.from_dict(content)
        for cell in mine.cells:
            cell.get("metadata", {}).pop("trusted", None)   # transient: never written
        return mine == on_disk
