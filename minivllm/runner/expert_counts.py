"""The MoE layers' per-expert token counters, brought to the host without stalling the device.

Each sparse layer counts, on the device, the tokens routed to each of its experts
(models/moe.py: `token_counts`). `ExpertCountsReader.poll()` runs after every finished step:
at most every `period_s` it queues a copy of the per-expert totals (summed over the layers)
into pinned host memory behind the work already queued, and a later poll publishes it once
its event has completed. So `latest` lags by up to a period and a step, and reading it never
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
            self.latest = tuple(self._pending[0].tolist())
            self._pending = None
        now = time.monotonic()
        if self._pending is not None or (now < self._next_due and not force):
            return
        self._next_due = now + self.period_s
        totals = self.model.expert_token_counts().sum(dim=0)
        if self.device.type != "cuda":
            self.latest = tuple(totals.tolist())
            return
        host = torch.empty(totals.shape, dtype=totals.dtype, pin_memory=True)
        host.copy_(totals, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)

    def per_layer(self) -> list[list[int]] | None:
        """Every MoE layer's counts [layers][experts], read now (waits for queued device work)."""
        if not self.enabled:
            return None
        return self.model.expert_token_counts().tolist()

    def reset(self) -> None:
        if self.enabled:
            self.model.reset_expert_token_counts()
        self.latest = None
        self._pending = None
        self._next_due = 0.0
