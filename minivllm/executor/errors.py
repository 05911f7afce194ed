"""The executor's one error: a rank is gone (died, or raised during a step)."""

from __future__ import annotations


class ExecutorDeadError(RuntimeError):
    """A worker rank died or raised; the executor cannot run another step."""
