"""CUDA graphs for decode steps and for small mixed (prefill + decode) steps.

Two kinds of graphs, captured at startup, largest first, all in one memory pool:

- decode: every sequence has one new token. Padded batch sizes 1, 2, 4, 8, 16, 24, ... up to
  max_num_seqs; attention runs the split-K decode kernel.
- mixed: any step (prompt chunks, prefix hits, decode tokens together) of up to the step
  budget (at most MAX_MIXED_TOKENS tokens), padded to a multiple of 64 tokens up to 1,024 and
  of 1/8 of the power of two below it above (`mixed_token_sizes`: under 12.5 % padding). Up to
  2,048 tokens the sequences are padded to 128, 512 or min(tokens, max_num_seqs)
  (`mixed_seq_sizes`): every padding sequence costs each attention launch a few empty programs
  per kv head, ~1 ms a step at 768 sequences against ~110 real ones (rate 16 of W3); larger
  steps (>= 40 ms of GPU time for Qwen3-8B) get the one size. Attention runs the decode kernel
  on the one-token rows and the prefill kernel, with its largest tile, on the rest.
  Eagerly, a step costs ~30-60 ms of host time for ~600 kernel launches (Qwen3-8B), as much
  as the GPU time of a 2,000-token step; replayed, well under 1 ms. Large steps are graphed
  too although their GPU time covers the launches: with async scheduling the previous step's
  tokens are taken in only after this step's launch returns, so the launch time lands in the
  inter-token latency of every running request (mean launch of W3's mixed steps: 19 -> 12 ms).

A step replays the graph of the smallest captured size that holds it: its inputs are copied
into static buffers, padding tokens have slot -1 (nothing stored) and belong to no sequence,
padding sequences have zero-length queries. The graph ends by copying the final hidden states
into one output buffer shared by every graph (so no graph keeps its own output alive in the
pool); the LM head runs eagerly on the rows that sample, so no graph holds a [tokens, vocab]
output.
"""

from __future__ import annotations

from collections import Counter

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.runner.input_batch import StepInputs

MAX_MIXED_TOKENS = 16384  # larger steps run eagerly (graph memory grows with the largest size)
MIXED_SEQ_BUCKETS = (128, 512)  # padded sequence counts of mixed graphs, below the largest ...
MIXED_SEQ_BUCKETS_MAX_TOKENS = 2048  # ... for graphs of up to this many tokens


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def mixed_token_sizes(max_num_batched_tokens: int, limit: int | None = None) -> list[int]:
    """Padded token counts of the mixed graphs: multiples of 64 up to 1,024, then in each range
    (2^k, 2^(k+1)] multiples of 2^k / 8 (128 up to 2,048, 256 up to 4,096, ...), so padding
    stays under 12.5 %. Such steps are GEMM-bound (~18 us per token for Qwen3-8B on an H200),
    so every padding token costs what a real one does. `limit` defaults to MAX_MIXED_TOKENS,
    read at call time (a profiling run may set it to try other graph sizes)."""
    limit = MAX_MIXED_TOKENS if limit is None else limit
    sizes = list(range(64, min(limit, 1024) + 1, 64))
    low = 1024
    while low < limit:
        sizes += range(low + low // 8, min(limit, 2 * low) + 1, low // 8)
        low *= 2
    covering = [s for s in sizes if s >= max_num_batched_tokens][:1]  # the step budget fits the last
    return [s for s in sizes if s < max_num_batched_tokens] + covering


def mixed_seq_sizes(tokens: int, max_num_seqs: int) -> list[int]:
    """Padded sequence counts of the mixed graphs of `tokens` tokens: the buckets below the
    most such a step can hold (min(tokens, max_num_seqs)), then that; only the latter above
    MIXED_SEQ_BUCKETS_MAX_TOKENS tokens."""
    most = min(tokens, max_num_seqs)
    if tokens > MIXED_SEQ_BUCKETS_MAX_TOKENS:
        return [most]
    return [s for s in MIXED_SEQ_BUCKETS if s < most] + [most]


class CudaGraphRunner:
    def __init__(self, runner, max_num_seqs: int, mixed: bool = True) -> None:
        self.runner = runner
        self.model = runner.model
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_bs = self.batch_sizes[-1]
        sched = runner.config.scheduler
        self.mixed_sizes = mixed_token_sizes(sched.max_num_batched_tokens) if mixed else []
        self.max_tokens = max([self.max_bs, *self.mixed_sizes])
        device = runner.device
        max_blocks = -(-sched.max_model_len // runner.block_size)
        # static inputs, shared by every graph (a graph of T tokens and S sequences reads the
        # first T token rows and the first S sequence rows)
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(self.max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_bs, max_blocks, dtype=torch.int32, device=device)
        hidden_size = runner.arch.hidden_size
        self.out = torch.zeros(self.max_tokens, hidden_size, dtype=runner.dtype, device=device)
        # key: (max_query_len, tokens, sequences); decode graphs have max_query_len 1 and
        # sequences == tokens, mixed ones max_query_len == tokens
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.replays: Counter[str] = Counter()  # "decode" / "mixed": steps that ran a graph
        self.largest_mixed_replayed = 0  # tokens of the largest mixed graph replayed so far

    def _meta(self, key: tuple[int, int, int]) -> AttentionMetadata:
        max_query_len, tokens, s = key
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], query_start_loc=self.query_start_loc[:s + 1],
            seq_lens=self.seq_lens[:s], block_tables=self.block_tables[:s], max_query_len=max_query_len,
            max_seq_len=self.runner.config.scheduler.max_model_len)

    def _forward(self, key: tuple[int, int, int]) -> None:
        tokens = key[1]
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], self._meta(key))
        self.out[:tokens].copy_(hidden)

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        backend = self.model.layers[0].self_attn.backend
        if hasattr(backend, "reserve_decode_workspace"):
            cfg = self.runner.arch
            backend.reserve_decode_workspace(self.max_bs, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             self.runner.config.scheduler.max_model_len, self.runner.device)
        # capture inputs: each sequence row a one-token query at position 0 of block 0, not stored
        self.query_start_loc.copy_(torch.arange(self.max_bs + 1, dtype=torch.int32))
        self.seq_lens.fill_(1)
        keys = [(t, t, s) for t in self.mixed_sizes for s in mixed_seq_sizes(t, self.max_bs)]
        keys += [(1, b, b) for b in self.batch_sizes]
        for key in sorted(keys, key=lambda k: k[1:], reverse=True):  # largest first: one shared pool
            self._forward(key)  # warm-up: triton compiles happen outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(key)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def _pick(self, inputs: StepInputs) -> tuple[int, int, int] | None:
        n, meta = inputs.input_ids.shape[0], inputs.meta
        if meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        if meta.is_decode_only:
            b = next((b for b in self.batch_sizes if b >= n), None)
            return None if b is None else (1, b, b)
        t = next((t for t in self.mixed_sizes if t >= n), None)
        if t is None:
            return None
        # sequences <= tokens and <= max_num_seqs, so the last size always fits
        s = next(s for s in mixed_seq_sizes(t, self.max_bs) if s >= meta.num_seqs)
        return t, t, s

    def try_run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's final hidden states [num_tokens, hidden] from a graph, or None if no
        captured graph holds the step (the caller runs it eagerly)."""
        key = self._pick(inputs)
        if key is None:
            return None
        n, meta = inputs.input_ids.shape[0], inputs.meta
        _, tokens, s_pad = key
        s = meta.num_seqs
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:tokens].fill_(-1)
        self.seq_lens[:s].copy_(meta.seq_lens)
        self.seq_lens[s:s_pad].fill_(0)
        self.query_start_loc[:s + 1].copy_(meta.query_start_loc)
        self.query_start_loc[s + 1:s_pad + 1].fill_(n)  # padding sequences: zero-length queries
        self.block_tables[:s, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[key].replay()
        self.replays["decode" if key[0] == 1 else "mixed"] += 1
        if key[0] != 1:
            self.largest_mixed_replayed = max(self.largest_mixed_replayed, tokens)
        return self.out[:n]
