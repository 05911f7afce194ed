"""CUDA graphs for decode steps.

Captured at startup for padded batch sizes 1, 2, 4, 8, 16, 24, ... up to max_num_seqs, largest
first, all in one memory pool. A decode step of n requests replays the graph of the smallest
captured size >= n: its inputs are copied into static buffers, the rows past n are padding
(zero-length query, slot -1: nothing stored, nothing attended). Anything else runs eagerly.
The graph ends at the final hidden states (small); the LM head runs eagerly on the n real rows,
so no graph holds a [batch, vocab] output of its own.
"""

from __future__ import annotations

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.runner.input_batch import StepInputs


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CudaGraphRunner:
    def __init__(self, runner, max_num_seqs: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_bs = self.batch_sizes[-1]
        device = runner.device
        max_blocks = -(-runner.config.scheduler.max_model_len // runner.block_size)
        # static inputs, shared by every graph (a graph of size b reads the first b rows)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(self.max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_bs, max_blocks, dtype=torch.int32, device=device)
        self.hidden: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.runner.config.scheduler.max_model_len)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        backend = self.model.layers[0].self_attn.backend
        if hasattr(backend, "reserve_decode_workspace"):
            cfg = self.runner.arch
            backend.reserve_decode_workspace(self.max_bs, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             self.runner.config.scheduler.max_model_len, self.runner.device)
        # capture inputs: each row a one-token sequence at position 0 of block 0, not stored
        self.query_start_loc.copy_(torch.arange(self.max_bs + 1, dtype=torch.int32))
        self.seq_lens.fill_(1)
        for bs in reversed(self.batch_sizes):
            self._forward(bs)  # warm-up: triton autotune/compile happen outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, inputs: StepInputs) -> bool:
        n = inputs.input_ids.shape[0]
        return (inputs.meta.max_query_len == 1 and n <= self.max_bs and len(inputs.sampling_req_ids) == n
                and inputs.meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, inputs: StepInputs) -> torch.Tensor:
        n = inputs.input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        meta = inputs.meta
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(0)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc)
        self.query_start_loc[n + 1:bs + 1].fill_(n)  # padding rows: zero-length queries
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[bs].replay()
        return self.model.compute_logits(self.hidden[bs][:n])
