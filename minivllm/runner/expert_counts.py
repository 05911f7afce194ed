"""The MoE layers' per-expert token counters, brought to the host without stalling the device.

Each sparse layer counts, on the device, the tokens routed to each of its experts
(models/moe.py: `token_counts`). `ExpertCountsReader.poll()` runs after every finished step:
at most every `period_s` it queues a copy of the per-layer counts into pinned host memory
behind the work already queued, and a later poll publishes it (`latest_per_layer`, and
`latest`, the totals over the layers; `version` counts publications) once its event has
completed. Under tensor/expert parallelism every TP rank counts all of its replica's tokens
(the router is replicated), so the driver rank's counts are the replica's, counted once. So `latest` lags by up to a period and a step, and reading it never
waits for the device (a blocking read would stall the step in flight under async scheduling).
On the CPU the totals are read at once.
"""

from __future__ import annotations

import time

import torch

DEFAULT_PERIOD_S = 1.0


class ExpertCountsReader:
    def __init__(self, model, device: torch.device, period_s: float = DEFAULT_PERIOD_S) -> None:
        self.model = model
        self.device = device
        self.period_s = period_s
        self.latest: tuple[int, ...] | None = None  # tokens routed to each expert, summed over layers
        self.latest_per_layer: list[list[int]] | None = None  # [MoE layers][experts]
        self.version = 0  # publications so far
        self._next_due = 0.0
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.model, "moe_blocks", None))

    def poll(self, force: bool = False) -> None:
        """Publish a completed copy; start a new one when due (or `force`)."""
        if not self.enabled:
            return
        if self._pending is not None and self._pending[1].query():
            self._publish(self._pending[0].tolist())
            self._pending = None
        now = time.monotonic()
        if self._pending is not None or (now < self._next_due and not force):
            return
        self._next_due = now + self.period_s
        counts = self.model.expert_token_counts()  # [layers, E]
        if self.device.type != "cuda":
            self._publish(counts.tolist())
            return
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)

    def _publish(self, per_layer: list[list[int]]) -> None:
        self.latest_per_layer = per_layer
        self.latest = tuple(sum(col) for col in zip(*per_layer))
        self.version += 1

    def per_layer(self) -> list[list[int]] | None:
        """Every MoE layer's counts [layers][experts], read now (waits for queued device work)."""
        if not self.enabled:
            return None
        return self.model.expert_token_counts().tolist()

    def reset(self) -> None:
        if self.enabled:
            self.model.reset_expert_token_counts()
        self.latest = self.latest_per_layer = None
        self._pending = None
        self._next_due = 0.0
