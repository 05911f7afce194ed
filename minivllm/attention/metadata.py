"""The per-step attention metadata the runner builds and every backend reads.

Token/block layout of one step (three requests, block_size 4):

    request A: 6 cached tokens + 2 new  (a prefill chunk or prefix hit)
    request B: 0 cached + 5 new         (a fresh prompt)
    request C: 9 cached + 1 new         (a decode step)

    query tokens (flattened):  A A | B B B B B | C        num_tokens = 8
    query_start_loc:           [0, 2, 7, 8]
    seq_lens (cached + new):   [8, 5, 10]
    block_tables[A] = [3, 7]   token i of A lives in slot block_tables[A][i // 4] * 4 + i % 4

New query token j of a sequence with q_len new tokens and seq_len total tokens sits at
position seq_len - q_len + j and attends causally to keys 0 .. that position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (-1: padding, not stored)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, cached + new tokens of each sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int  # longest number of new tokens of one sequence this step
    max_seq_len: int  # longest seq_len this step
    # Host copies, used by the reference backend's per-sequence loop (no device sync needed).
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
