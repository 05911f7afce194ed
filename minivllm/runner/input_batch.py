"""Flattens one SchedulerOutput into the tensors of a forward pass (the "super-sequence")."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.core.interfaces import PLACEHOLDER_TOKEN, ScheduledRequest


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    # [num_logits] int64: the last token of each sampling request, or with speculative decoding
    # its last 1 + num_draft_tokens tokens (the verify rows, see spec_decode/rejection.py)
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]  # requests that sample this step, in logits order
    # flat positions whose token is PLACEHOLDER_TOKEN, and the request each belongs to
    placeholder_positions: list[int]
    placeholder_req_ids: list[str]
    # speculative decoding: the tokens each sampling request verifies (aligned with
    # sampling_req_ids); None when no request of the step has any
    draft_token_ids: list[list[int]] | None = None
    # [num_requests + 1] each scheduled request's first flat token (the attention metadata's
    # query_start_loc unless the step's verify rows attend as one-token sequences, see below)
    request_starts: list[int] | None = None


class BlockTableRows:
    """Every request's block table as a row of one int32 array, kept in step with the runner's
    lists: a step's [n, max_blocks] table is then one gather instead of n Python lists turned
    into numpy (scripts/host_step_bench.py, 256 requests of ~65 blocks on the development CPU:
    the step's input arrays 1.1-1.5 ms from the lists, 0.5-0.7 ms with the rows, in series with
    every step on each rank). Entries past a row's length are 0, as in the lists' table."""

    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self.table = np.zeros((rows, cols), dtype=np.int32)
        self.lens = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def set(self, req_id: str, blocks: list[int]) -> None:
        """The request's whole table (a new request, or one whose table changed in place)."""
        row = self.row_of.get(req_id)
        if row is None:
            if not self._free:
                self._grow_rows()
            row = self.row_of[req_id] = self._free.pop()
        self._fit(len(blocks))
        self.table[row] = 0
        self.table[row, :len(blocks)] = blocks
        self.lens[row] = len(blocks)

    def extend(self, req_id: str, blocks: list[int]) -> None:
        row = self.row_of[req_id]
        start = int(self.lens[row])
        self._fit(start + len(blocks))
        self.table[row, start:start + len(blocks)] = blocks
        self.lens[row] = start + len(blocks)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def gather(self, req_ids: list[str]) -> np.ndarray:
        """[len(req_ids), longest table] int32, rows in req_ids' order."""
        rows = np.fromiter((self.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        return self.table[rows, :max(1, int(self.lens[rows].max()))]

    def _fit(self, cols: int) -> None:
        if cols > self.table.shape[1]:
            self.table = np.pad(self.table, ((0, 0), (0, max(cols, 2 * self.table.shape[1]) - self.table.shape[1])))

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        self.table = np.pad(self.table, ((0, old), (0, 0)))
        self.lens = np.pad(self.lens, (0, old))
        self._free = list(range(2 * old - 1, old - 1, -1))


def build_step_inputs(
    scheduled: list[ScheduledRequest],
    block_ids: dict[str, list[int]] | BlockTableRows,  # the runner's block table of each request
    block_size: int,
    device: torch.device,
    pin: bool,
) -> StepInputs:
    n = len(scheduled)
    q_lens = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=n)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=n)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    # position of each token: its request's start + its offset inside the request's chunk
    seq_idx = np.repeat(np.arange(n), q_lens)
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, q_lens)
    input_ids = np.fromiter((t for s in scheduled for t in s.token_ids), dtype=np.int64, count=total)

    if isinstance(block_ids, BlockTableRows):
        block_table = block_ids.gather([s.req_id for s in scheduled])
    else:
        tables = [block_ids[s.req_id] for s in scheduled]
        block_table = np.zeros((n, max(len(t) for t in tables)), dtype=np.int32)
        for i, t in enumerate(tables):
            block_table[i, :len(t)] = t
    slot_mapping = block_table[seq_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = (starts + q_lens).astype(np.int32)
    sampling = [i for i, s in enumerate(scheduled) if s.samples]
    drafts = None
    if any(s.num_draft_tokens for s in scheduled):
        drafts = [scheduled[i].token_ids[len(scheduled[i].token_ids) - scheduled[i].num_draft_tokens:]
                  for i in sampling]
        # each request's last 1 + k tokens, in order: its end - (k + 1) .. end - 1
        widths = np.asarray([len(d) + 1 for d in drafts], dtype=np.int64)
        first = np.repeat(cu[1:][sampling] - widths, widths)
        within = np.arange(int(widths.sum())) - np.repeat(np.cumsum(widths) - widths, widths)
        logits_indices = first + within
    else:
        logits_indices = cu[1:][sampling] - 1

    att_cu, att_lens, att_table, max_query_len = cu, seq_lens, block_table, int(q_lens.max())
    if drafts is not None and all(s.samples and len(s.token_ids) == s.num_draft_tokens + 1 for s in scheduled):
        # A pure verify step (every request decodes its last token and its drafts): each token
        # attends as a one-token sequence of its own (seq_len = its position + 1, its request's
        # block table), causal by construction. The step is then decode-only: the split-K decode
        # kernel and the decode CUDA graphs, instead of the prefill kernel's one program per
        # (request, kv head) walking the whole context serially (issue 19, batch-1 verify).
        att_cu = np.arange(total + 1, dtype=np.int64)
        att_lens = (positions + 1).astype(np.int32)
        att_table = block_table[seq_idx]
        max_query_len = 1

    slots_d, qsl_d, lens_d, table_d, ids_d, pos_d, logits_d = to_device_packed(
        [slot_mapping, att_cu.astype(np.int32), att_lens, att_table, input_ids, positions,
         logits_indices.astype(np.int64)], device, pin)
    meta = AttentionMetadata(
        slot_mapping=slots_d,
        query_start_loc=qsl_d,
        seq_lens=lens_d,
        block_tables=table_d,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=att_cu.tolist(),
        seq_lens_cpu=att_lens.tolist(),
    )
    holes = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN).tolist()
    return StepInputs(ids_d, pos_d, meta, logits_d,
                      [scheduled[i].req_id for i in sampling], holes, [scheduled[seq_idx[h]].req_id for h in holes],
                      drafts, cu.tolist())


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
ALIGN = 16  # bytes between the starts of to_device_packed's arrays (a multiple of)


def one_copy_enabled() -> bool:
    """Step inputs through one host-to-device copy (to_device_packed), unless
    MINIVLLM_STEP_INPUTS_ONE_COPY=0 (A/B runs: one copy an array). Read at each step."""
    return os.environ.get("MINIVLLM_STEP_INPUTS_ONE_COPY", "1") != "0"


def to_device_packed(arrays: list[np.ndarray], device: torch.device, pin: bool) -> list[torch.Tensor]:
    """Host int32/int64 arrays -> tensors of the same dtypes and shapes on `device`, through ONE
    host-to-device copy: the arrays laid end to end in one byte buffer (each at an offset that is
    a multiple of ALIGN bytes), pinned (pin) and copied without waiting; each tensor is a view of the
    one device buffer. Why: a small copy costs the device ~2.8 us however few its bytes, and the
    copies of a step run one after another before its first kernel (lease 56's W11-awq trace: 9 of
    them a batch-1 decode step). Offsets are multiples of ALIGN bytes, so every view's address is
    as aligned as a tensor of its own (Triton specializes kernels on 16-byte-divisible pointers:
    an odd alignment would compile other variants at run time). On the CPU (pin False) the views
    share the host buffer."""
    if not one_copy_enabled():
        return [_to_device(a, device, pin) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    buf = np.empty(max(total, ALIGN), dtype=np.uint8)
    for a, off in zip(arrays, offsets):
        buf[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    host = torch.from_numpy(buf)
    if pin:
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return [dev[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]


def _to_device(a: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(a)
    if pin:
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
