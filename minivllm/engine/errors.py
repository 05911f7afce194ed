"""Errors an engine client sees (shared by LLMEngine, AsyncEngine and MPAsyncEngine)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine stopped (crash, a dead rank, or shutdown); no request can make progress."""


class EngineClosedError(RuntimeError):
    """The engine is draining or shut down and takes no new requests."""
