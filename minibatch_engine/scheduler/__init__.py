"""Schedulers: every batching strategy of the book behind one interface."""
from .base import Scheduler
from .continuous import ContinuousScheduler
from .static import StaticScheduler

__all__ = ["Scheduler", "StaticScheduler", "ContinuousScheduler"]
