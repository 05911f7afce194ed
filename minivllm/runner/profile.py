"""A synthetic step for memory profiling: num_seqs prompts splitting num_tokens tokens."""

from __future__ import annotations

import torch

from minivllm.core.interfaces import ScheduledRequest
from minivllm.runner.input_batch import StepInputs, build_step_inputs


def dummy_step_inputs(num_tokens: int, num_seqs: int, block_size: int, device: torch.device) -> StepInputs:
    num_seqs = max(1, min(num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    scheduled, block_ids, next_block = [], {}, 0
    for i in range(num_seqs):
        n = base + (1 if i < extra else 0)
        blocks = -(-n // block_size)
        block_ids[str(i)] = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append(ScheduledRequest(str(i), [0] * n, 0, [], True))
    return build_step_inputs(scheduled, block_ids, block_size, device, pin=False)


def blocks_for_dummy_step(num_tokens: int, num_seqs: int, block_size: int) -> int:
    num_seqs = max(1, min(num_seqs, num_tokens))
    return -(-num_tokens // block_size) + num_seqs
