"""The Triton attention backend: our own paged-KV kernels (minivllm/kernels).

Triton is imported only when this backend is constructed, so `minivllm` (and this module)
import on machines without triton.

Kernel choice per step: sequences with one new token (decode rows) go to the split-K decode
kernel, all others (prompts, chunks, prefix hits) to the variable-length prefill kernel. A
mixed step launches both; each leaves the other's rows alone. Both kernels find their rows on
the device, so the launches depend on shapes only (CUDA-graph safe). The decode kernel reads
one-token queries' keys ~20 % faster than the prefill kernel's 64-row tiles
(scripts/sweep_decode_attention.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.kernels.device import num_sms as num_sms_of

if TYPE_CHECKING:
    from minivllm.kernels.decode_attention import DecodeWorkspace


# batch-invariant mode: every row goes through the prefill kernel with one tile size whatever
# the step's real query lengths: the smallest BLOCK_M (16 rows, or one GQA group if larger; see
# invariant_max_query_len). A decode row fills GROUP rows of its tile, so a 64-row tile (the
# mode's first choice) spent 31/32 of its QK and PV products on padding for Qwen3-0.6B (GROUP 2):
# lease 9's profile-bi had this attention at 3.83 ms a step against 3.07 for the default mode's
# decode kernel, which reads the same K/V. Prompt rows pay with more programs re-reading K/V.
INVARIANT_BLOCK_M = 16


def invariant_max_query_len(group: int) -> int:
    """The max_query_len that makes prefill_config pick BLOCK_M = max(INVARIANT_BLOCK_M,
    next_pow2(group)) (a constant per model: the tile never depends on the step)."""
    return max(1, INVARIANT_BLOCK_M // group)


class TritonAttentionBackend:
    name = "triton"
    # the prefill kernel's launch depends on shapes and max_query_len only (no host reads of
    # the metadata), so mixed steps can be captured in CUDA graphs
    graph_safe_prefill = True

    def __init__(self) -> None:
        # lazy: these modules import triton
        from minivllm.kernels import decode_attention, prefill_attention, store_kv

        self._store_kv = store_kv.store_kv
        self._rotary_store_kv = store_kv.rotary_store_kv
        self._can_rotary_store = store_kv.can_rotary_store
        self._prefill = prefill_attention.prefill_attention
        self._decode = decode_attention.decode_attention
        self._workspace_cls = decode_attention.DecodeWorkspace
        self._choose_splits = decode_attention.choose_num_splits
        # (workspace, max_seq_len, num_sms), set by reserve_decode_workspace
        self._reserved: tuple[DecodeWorkspace, int, int] | None = None
        # batch-invariant mode (set by the runner): every row through the prefill kernel with
        # one fixed tile size and every key tile through its masked path, so a row's
        # arithmetic never depends on the step's other rows or on how its prompt was chunked
        self.invariant = False

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
        k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches only
        v_scale: torch.Tensor | None = None,
    ) -> None:
        self._store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def rotary_store_kv(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        cos_sin: torch.Tensor,  # [max_pos, head_dim] float32: cos | sin
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,  # q/k RMSNorm weights (Qwen3)
        eps: float = 0.0,
    ) -> torch.Tensor | None:
        """Rotary (after the q/k norm, with norm_weights) and store_kv in one kernel: returns the
        rotated q, or None where the kernel does not take these tensors (the layer then runs
        the rotary and store_kv apart)."""
        if not self._can_rotary_store(positions, q, k, v, cos_sin, k_cache, v_cache, norm_weights):
            return None
        return self._rotary_store_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                                     norm_weights, eps)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches only
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if self.invariant:
            group = query.shape[1] // k_cache.shape[2]
            return self._prefill(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 scale, max_query_len=invariant_max_query_len(group), k_scale=k_scale,
                                 v_scale=v_scale, invariant=True)
        if meta.is_decode_only:
            ws, num_splits = self._decode_plan(meta.num_seqs, query.shape[1], k_cache.shape[2])
        else:
            # mixed step: one split. The prompt rows give the GPU work enough, and the result
            # must not depend on how many sequences the step was padded to (a split count from
            # the padded count would make a mixed CUDA graph's numbers differ from eager's)
            ws, num_splits = None, 1
        out = self._decode(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            max_seq_len=meta.max_seq_len, num_splits=num_splits, workspace=ws, k_scale=k_scale, v_scale=v_scale,
        )
        if meta.is_decode_only:
            return out
        return self._prefill(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            max_query_len=meta.max_query_len, out=out, skip_single_token=True, k_scale=k_scale, v_scale=v_scale,
        )

    def reserve_decode_workspace(
        self,
        max_num_seqs: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        device: torch.device | str,
    ) -> None:
        """Preallocate decode scratch and make the split count static (call before CUDA-graph capture).

        Afterwards a decode step of num_seqs <= max_num_seqs sequences always uses these buffers
        and a split count that depends only on num_seqs (chosen as if every sequence were
        max_seq_len long), never on this step's lengths, so a graph captured for a padded
        batch size replays correctly whatever the sequences' lengths.
        """
        num_sms = num_sms_of(device)
        most = self._choose_splits(1, num_kv_heads, max_seq_len, num_sms)
        ws = self._workspace_cls.allocate(max_num_seqs, num_heads, head_dim, most, device)
        self._reserved = (ws, max_seq_len, num_sms)

    def _decode_plan(self, num_seqs: int, num_heads: int, num_kv_heads: int) -> tuple[DecodeWorkspace | None, int | None]:
        """(workspace, num_splits) for this step; (None, None) lets the kernel choose (eager only)."""
        if self._reserved is None:
            return None, None
        ws, max_seq_len, num_sms = self._reserved
        if ws.part_lse.shape[0] < num_seqs or ws.part_lse.shape[1] != num_heads:
            return None, None
        splits = self._choose_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)
        return ws, min(splits, ws.num_splits)
