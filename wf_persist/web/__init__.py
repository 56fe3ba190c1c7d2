"""The web view of runs (``wf-persist web``; the ``web`` extra): see :mod:`.app`."""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
