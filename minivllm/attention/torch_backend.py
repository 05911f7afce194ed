"""The plain-PyTorch backend: the CPU path. Decode rows are batched into one SDPA call over
the gathered blocks; prefill rows run one SDPA call each. Tested against reference.py.

On a CPU with the compiled decode kernel (`kernels/cpu_kernels.py`, handed over by the runner
through `use_cpu_kernel`), float32 steps go to it instead: it reads the blocks in place. A step
with prompt tokens becomes one kernel call too, each query token a row of its own that attends
to its causal prefix (`_causal_rows`).

Everything that depends only on the step's metadata (which rows decode, the gather indices, the
length mask) is worked out once per step, at the first layer, and reused by the other layers:
the runner builds one AttentionMetadata per step and every layer gets that same object."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.reference import as_indexable, from_cache, gather_kv, store_kv_reference, to_cache
from minivllm.kernels import cpu_kernels


@dataclass
class _StepPlan:
    block_size: int
    decode_rows: int  # number of decode rows (one query token each)
    decode_tokens: torch.Tensor | None  # their token rows; None: every token is a decode row
    gather: torch.Tensor | None  # [B * num_blocks] block ids of the decode rows, row-major
    gather_start: int | None  # set when those ids are consecutive: read the blocks in place
    kv_len: int  # gathered keys per decode row are sliced to this
    mask: torch.Tensor | None  # [B, 1, 1, kv_len] valid keys; None: every row has kv_len keys
    tables: torch.Tensor | None  # [B, max_blocks] int32 block tables of the decode rows
    lens: torch.Tensor | None  # [B] int32 their sequence lengths
    prefills: list[tuple[int, int, int, int]]  # (row, start, end, seq_len) of multi-token rows
    # set by the backend when the CPU kernel serves every token of a step with prefill rows:
    # ([T, max_blocks] int32 tables, [T] int32 causal lengths), see _causal_rows
    causal_rows: tuple[torch.Tensor, torch.Tensor] | None = None


def _plan_step(meta: AttentionMetadata, block_size: int, num_tokens: int, device) -> _StepPlan:
    qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    rows = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    prefills = [(i, qsl[i], qsl[i + 1], lens[i]) for i in range(len(lens)) if qsl[i + 1] - qsl[i] > 1]
    if not rows:
        return _StepPlan(block_size, 0, None, None, None, 0, None, None, None, prefills)
    all_rows = len(rows) == len(lens)
    idx = None if all_rows else torch.tensor(rows, device=device)
    tables = meta.block_tables if all_rows else meta.block_tables[idx]
    row_lens = [lens[i] for i in rows]
    kv_len = max(row_lens)
    num_blocks = -(-kv_len // block_size)
    gather = tables[:, :num_blocks].reshape(-1)
    # a lone sequence often owns consecutive blocks (the free queue hands them out in order):
    # then every layer can view them instead of copying them out (one check per step)
    first, consecutive = 0, False
    if gather.device.type == "cpu":  # (on a GPU this check would wait for the device)
        first = int(gather[0])
        consecutive = bool((gather == torch.arange(first, first + gather.numel(), dtype=gather.dtype)).all())
    mask = None
    if min(row_lens) != kv_len:
        seq_lens = meta.seq_lens if all_rows else meta.seq_lens[idx]
        mask = (torch.arange(kv_len, device=device)[None, :] < seq_lens[:, None])[:, None, None, :]
    token_rows = [qsl[i] for i in rows]
    decode_tokens = None if len(rows) == num_tokens else torch.tensor(token_rows, device=device)
    lens_t = meta.seq_lens if all_rows else meta.seq_lens[idx]
    return _StepPlan(block_size, len(rows), decode_tokens, gather, first if consecutive else None, kv_len, mask,
                     tables, lens_t, prefills)


def _causal_rows(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every query token of the step as a row of the decode kernel: its sequence's block table
    and its causal key count. New token t of a sequence whose new tokens end at e (query_start_loc)
    sits at position seq_len - (e - t) and attends to that many keys plus one. None when the
    tokens do not tile the sequences exactly (padding rows: never on the CPU)."""
    qsl = meta.query_start_loc.to(torch.int64)
    if int(qsl[-1]) != num_tokens:
        return None
    seq_of_token = torch.repeat_interleave(torch.arange(qsl.numel() - 1), qsl[1:] - qsl[:-1])  # [T]
    lens = meta.seq_lens.to(torch.int64)[seq_of_token] - qsl[1:][seq_of_token] + torch.arange(num_tokens) + 1
    return meta.block_tables.index_select(0, seq_of_token), lens.to(torch.int32)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._slots: tuple[torch.Tensor, bool] | None = None  # (slot_mapping, has no padding)
        self._plan: tuple[AttentionMetadata, _StepPlan] | None = None
        self._cpu_ops = None  # the compiled CPU decode kernel's ops, when the runner hands them over

    def use_cpu_kernel(self, ops) -> None:
        """Serve float32 CPU decode rows with the compiled kernel (kernels/cpu_kernels.py)."""
        self._cpu_ops = ops

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        """An FP8 cache stores K / k_scale and V / v_scale (reference.to_cache)."""
        if slot_mapping.device.type == "cpu":
            if self._slots is None or self._slots[0] is not slot_mapping:
                self._slots = (slot_mapping, bool((slot_mapping >= 0).all()))
            if self._slots[1]:
                # no padding slots (the CPU runs no CUDA graphs): one index_copy_ per cache instead
                # of the reference's boolean-mask gathers
                for cache, x, s in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
                    as_indexable(cache).view(-1, *cache.shape[2:]).index_copy_(
                        0, slot_mapping, as_indexable(to_cache(x, cache.dtype, s)))
                return
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def _step_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, query: torch.Tensor) -> _StepPlan:
        block_size = k_cache.shape[1]
        if self._plan is None or self._plan[0] is not meta or self._plan[1].block_size != block_size:
            plan = _plan_step(meta, block_size, query.shape[0], query.device)
            if self._cpu_ops is not None and plan.prefills and cpu_kernels.supports(query, k_cache):
                # prompt tokens go to the kernel too, one row each (one call for the whole step
                # instead of an SDPA call per sequence and layer: W5's prefill attention 0.44 ->
                # 0.13 s, docs/perf.md session 8)
                plan.causal_rows = _causal_rows(meta, query.shape[0])
            if self._cpu_ops is not None and (plan.decode_rows or plan.causal_rows is not None):
                # once per step, before any kernel call (the causal rows read the same blocks,
                # up to each sequence's length)
                cpu_kernels.check_decode_rows(meta.block_tables, meta.seq_lens, k_cache.shape[0], block_size)
            self._plan = (meta, plan)
        return self._plan[1]

    def attend(self, query: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               k_scale=None, v_scale=None):
        """An FP8 cache's blocks are read back as K * k_scale, V * v_scale in the query's dtype
        (the compiled CPU kernel takes float32 caches only: FP8 steps take the SDPA paths)."""
        plan = self._step_plan(meta, k_cache, query)
        if plan.causal_rows is not None:
            return self._causal(query, k_cache, v_cache, plan, scale)
        scales = (k_scale, v_scale)
        if plan.decode_rows and plan.decode_tokens is None:
            return self._decode(query, k_cache, v_cache, plan, scale, scales)  # a decode-only step
        out = torch.empty_like(query)
        if plan.decode_rows:
            out[plan.decode_tokens] = self._decode(query[plan.decode_tokens], k_cache, v_cache, plan, scale, scales)
        for row, start, end, seq_len in plan.prefills:
            out[start:end] = _prefill_one(query[start:end], k_cache, v_cache, meta.block_tables[row], seq_len, scale,
                                          scales)
        return out


    def attend_rows(self, query: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    rows: torch.Tensor) -> torch.Tensor | None:
        """attend(...)[rows] computed for those token rows only, where the CPU kernel serves every
        token of the step as a row of its own (a step with prompt tokens); None elsewhere."""
        plan = self._step_plan(meta, k_cache, query)
        if plan.causal_rows is None:
            return None
        return self._causal(query, k_cache, v_cache, plan, scale, rows)

    def _causal(self, query, k_cache, v_cache, plan: _StepPlan, scale: float,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every token of the step (or the token rows `rows`) as a row of the CPU kernel over its
        causal prefix (plan.causal_rows)."""
        tables, lens = plan.causal_rows
        if rows is not None:
            query, tables, lens = query.index_select(0, rows), tables.index_select(0, rows), lens.index_select(0, rows)
        return cpu_kernels.paged_decode_attention(self._cpu_ops, query, k_cache, v_cache, tables, lens, scale,
                                                  checked=True)

    def _decode(self, q, k_cache, v_cache, plan: _StepPlan, scale: float, scales=(None, None)) -> torch.Tensor:
        if self._cpu_ops is not None and cpu_kernels.supports(q, k_cache):
            return cpu_kernels.paged_decode_attention(self._cpu_ops, q, k_cache, v_cache, plan.tables, plan.lens,
                                                        scale, checked=True)
        return _decode(q, k_cache, v_cache, plan, scale, scales)


def _decode(q, k_cache, v_cache, plan: _StepPlan, scale: float, scales=(None, None)) -> torch.Tensor:
    """One query token per row: gather each row's blocks, mask past its length, one SDPA call."""
    b, num_kv, d = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    if plan.gather_start is not None:
        k = k_cache.narrow(0, plan.gather_start, plan.gather.numel())
        v = v_cache.narrow(0, plan.gather_start, plan.gather.numel())
    else:
        k = as_indexable(k_cache).index_select(0, plan.gather).view(k_cache.dtype)
        v = as_indexable(v_cache).index_select(0, plan.gather).view(v_cache.dtype)
    k = from_cache(k.view(b, -1, num_kv, d)[:, :plan.kv_len], scales[0], q.dtype).transpose(1, 2)
    v = from_cache(v.view(b, -1, num_kv, d)[:, :plan.kv_len], scales[1], q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=plan.mask, scale=scale,
                                       enable_gqa=True)  # [B, Hq, 1, D]
    return o.squeeze(2)


def _prefill_one(q, k_cache, v_cache, block_table, seq_len: int, scale: float, scales=(None, None)) -> torch.Tensor:
    q_len = q.shape[0]
    k = from_cache(gather_kv(k_cache, block_table, seq_len), scales[0], q.dtype).transpose(0, 1)  # [Hk, L, D]
    v = from_cache(gather_kv(v_cache, block_table, seq_len), scales[1], q.dtype).transpose(0, 1)
    # 4-D [1, H, L, D]: with 3-D inputs the CPU picks SDPA's math fallback (~3x slower here)
    qt, k, v = q.transpose(0, 1)[None], k[None], v[None]  # [1, Hq, q_len, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # a chunk after a cached prefix: query j sits at position seq_len - q_len + j
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
