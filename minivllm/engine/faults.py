"""Fault injection for the soak and fault suite (`minivllm bench soak`), off unless asked for:

    MINIVLLM_FAULT_INJECTION='{"step_failure_rate": 0.01, "request_failure_rate": 0.02, "seed": 0}'

Each step launch then fails with probability step_failure_rate (as a device error would: the
step's requests end with "error"), or blames one of its requests with probability
request_failure_rate (RequestFault: that request alone ends with "error", the others are
recomputed). Read by every LLMEngine, so it also reaches the engine-core process of the server.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass

from minivllm.core.interfaces import RequestFault

ENV = "MINIVLLM_FAULT_INJECTION"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultInjection:
    step_failure_rate: float = 0.0
    request_failure_rate: float = 0.0
    seed: int = 0

    @classmethod
    def from_env(cls) -> FaultInjection | None:
        raw = os.environ.get(ENV)
        if not raw:
            return None
        try:
            fi = cls(**json.loads(raw))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{ENV} must be JSON with step_failure_rate, request_failure_rate, seed: {e}") from None
        if not (0 <= fi.step_failure_rate <= 1 and 0 <= fi.request_failure_rate <= 1):
            raise ValueError(f"{ENV}: the rates must lie in [0, 1], got {fi}")
        return fi

    def install(self, executor) -> None:
        """Wrap executor.launch so that steps fail as configured."""
        rng, real = random.Random(self.seed), executor.launch
        logger.warning("fault injection on: %s", self)

        def launch(sched):
            if sched.scheduled:
                x = rng.random()
                if x < self.step_failure_rate:
                    raise RuntimeError("injected step failure (MINIVLLM_FAULT_INJECTION)")
                if x < self.step_failure_rate + self.request_failure_rate:
                    victim = rng.choice(sched.scheduled).req_id
                    raise RequestFault([victim], "injected request failure (MINIVLLM_FAULT_INJECTION)")
            return real(sched)
        executor.launch = launch
