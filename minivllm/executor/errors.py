"""The executor's one error: a rank is gone (died, or raised during a step)."""

from __future__ import annotations


class ExecutorDeadError(RuntimeError):
    """A worker rank died or raised; the executor cannot run another step."""


class DeathLatch:
    """Once a rank is gone the executor stays dead: every later call raises the same error.
    Subclasses set `_dead = None` and define `_stop_ranks()` (stop every other rank at once:
    they may be waiting for the dead one in a collective) and `_name`."""

    _dead: ExecutorDeadError | None = None
    _name = "executor"

    def _stop_ranks(self) -> None:
        raise NotImplementedError

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _fail(self, reason: str):
        if self._dead is None:
            import logging
            self._dead = ExecutorDeadError(reason)
            logging.getLogger(type(self).__module__).error("%s: %s", self._name, reason)
            self._stop_ranks()
        raise self._dead
