"""The model runner: the only part that touches tensors.

It keeps a small per-request state (block table, tokens for penalties), turns each
SchedulerOutput into one flattened batch, runs the model (eagerly or through a captured CUDA
graph), samples on the device and returns plain Python data (one device-to-host copy a step).

Under tensor/pipeline parallelism there is one runner per rank (executor/worker.py), each given
the same SchedulerOutput: it holds its shard of the model and of the KV cache, a stage after
the first receives the step's hidden states from the one before and a stage before the last
sends them on (returning no tokens); every rank of the last stage samples, from the same
gathered logits with the same seeded generator, so all of them hold the same tokens.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.attention.backend import get_attention_backend
from minivllm.config import EngineConfig
from minivllm.core.interfaces import NewRequestData, RunnerOutput, SchedulerOutput, TokenLogprobs
from minivllm.core.swap_space import SwapCosts
from minivllm.distributed.parallel_state import ParallelGroups
from minivllm.models.llama import CausalLM, IntermediateTensors
from minivllm.models.loader import build_model
from minivllm.runner.extra_outputs import ExtraRows, plan_extra_rows, pool, prompt_logprobs
from minivllm.runner.expert_counts import ExpertCountsReader
from minivllm.runner.input_batch import BlockTableRows, StepInputs, build_step_inputs
from minivllm.runner.kv_cache import allocate_kv_cache, bytes_per_block, format_bytes
from minivllm.runner.memory import plan_num_blocks
from minivllm.sample.batch import SamplingBatch, SamplingRequestState
from minivllm.sample.sampler import HostSamplerOutput, Sampler, SamplerOutput
from minivllm.structured.bitmask import GrammarBitmask, apply_token_bitmask

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LaunchedStep:
    """A step whose device work is queued; `finish` waits for it."""

    req_ids: list[str]  # requests that sample, in row order
    states: list[SamplingRequestState]
    host: HostSamplerOutput | None = None  # already on the host (blocking path)
    host_buf: torch.Tensor | None = None  # pinned [B] int64, filled by an async copy
    event: torch.cuda.Event | None = None  # recorded after that copy
    spec: RunnerOutput | None = None  # speculative decoding: the finished step's output
    # prompt logprobs and pooled vectors of the step (already on the host)
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    pooled: dict[str, list[float]] | None = None


@dataclass
class ForwardStep:
    """A step whose forward is queued and whose sampling is not (launch_sampling does it)."""

    hidden: torch.Tensor | None  # [rows, H]: the final hidden states of the sampling rows (and drafts)
    req_ids: list[str]  # requests that sample, in row order
    inputs: StepInputs | None = None
    # (prompt logprobs, pooled vectors) of the step, already on the host (runner/extra_outputs.py)
    extras: tuple[dict | None, dict | None] = (None, None)


@dataclass(frozen=True)
class HostKVTiers:
    """The host pools the runner allocated, in blocks, for the engine's core bookkeeping."""

    num_swap_blocks: int
    num_offload_blocks: int
    block_bytes: int  # one block of the whole KV cache (every layer, K and V)
    swap_costs: SwapCosts  # the swap-or-recompute cost model's estimates


@dataclass
class RunnerRequest:
    block_ids: list[int]
    sampling: SamplingRequestState
    lora_request: object | None = None  # LoRARequest
    pooling: object | None = None  # PoolingParams (resolved: pooling_type set)
    beam_temperature: float | None = None
    pool_sum: torch.Tensor | None = None  # mean pooling: float32 sum of the rows so far
    pool_count: int = 0


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelGroups | None = None,
                 device: torch.device | None = None) -> None:
        """parallel: this rank's process groups (None: world size 1); device: this rank's
        device (default: config.device)."""
        self.config = config
        self.device = device if device is not None else torch.device(config.device)
        self.parallel = parallel if parallel is not None else ParallelGroups.single(self.device)
        self.dtype = _DTYPES[config.model.dtype]
        # the KV cache's element type: the model's, or float8 e4m3 (kv_cache_dtype="fp8")
        self.kv_dtype = torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8" else self.dtype
        self.block_size = config.cache.block_size
        self.arch = config.model.arch
        self.requests: dict[str, RunnerRequest] = {}
        self.block_rows = BlockTableRows()  # the requests' block tables as numpy rows (kept by _update_states)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.model: CausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.graphs = None  # CudaGraphRunner once captured
        self.speculator = None  # spec_decode.Speculator with speculative decoding
        self.draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # a draft model's own
        # each request's latest sampled token on the device: (its step's sampled ids, its row).
        # A placeholder reads it. It is usually the last launched step's, but with two steps in
        # flight (an mp engine core runs ahead, engine/llm_engine.py) a request the step before
        # skipped reads the one before that.
        self._sampled_at: dict[str, tuple[torch.Tensor, int]] = {}
        # the first real step runs eagerly and calibrates the FP8 KV scales (calculate_kv_scales)
        self._calibrate_kv_pending = config.cache.calculate_kv_scales
        self.timings: dict[str, float] = {}
        self.expert_counts: ExpertCountsReader | None = None  # MoE models' per-expert token counters
        self._counts_sent = 0  # the expert_counts.version last attached to a RunnerOutput
        self.lora = None  # lora.manager.LoRAManager with enable_lora
        self.kv_transfer = None  # kv_transfer.BlockTransferEngine: swap space and offload tier
        # several engines on one GPU: what was in use before this one loaded (memory.py)
        self.others_bytes_at_start = 0
        if config.cache.kv_budget_own_process and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self.others_bytes_at_start = total - free
        # batch-invariant mode: the engine seed that per-request seeds derive from (None: off)
        self._invariant_seed = config.model.seed if config.batch_invariant else None

    # ---- startup --------------------------------------------------------------------------
    def load_model(self, model: CausalLM | None = None) -> None:
        """Build and load the model, or take `model`: one this runner's config built and set up
        before (another engine's, e.g. the configuration-grid harness's; its KV cache is replaced
        by init_kv_cache, so that engine must not run any more)."""
        t = time.perf_counter()
        if model is not None:
            self.model = model
        else:
            backend = get_attention_backend(self.config.attention_backend)
            self.model = build_model(self.config.model, backend, self.device, self.dtype, self.parallel)
            self.setup_cpu_model(self.model)
            self._setup_lora()
            if self.config.batch_invariant:
                self._make_batch_invariant(self.model)
            elif self.device.type == "cuda":
                self._use_dense_gemv(self.model)
                self._fuse_fp8_activation_quant(self.model)
                self._attach_w4_layer_tails(self.model)
        self.expert_counts = ExpertCountsReader(self.model, self.device)
        if self.config.speculative is not None:
            from minivllm.spec_decode import make_speculator
            self.speculator = make_speculator(self.config.speculative, self)
        self.timings["load_model_s"] = time.perf_counter() - t
        logger.info("loaded %s (%s, %s) in %.1f s", self.config.model.served_name, self.config.model.dtype,
                    self.device, self.timings["load_model_s"])

    def _setup_lora(self) -> None:
        """enable_lora: the decoder's linears get adapter slots (lora/layers.py), after packing
        (a LoRALinear wraps the packed layer)."""
        if self.config.lora is None:
            return
        from minivllm.lora.manager import LoRAManager
        # the token-slot buffer covers the largest step a CUDA graph pads to
        max_tokens = 2 * self.config.scheduler.max_num_batched_tokens + 1024
        self.lora = LoRAManager(self.config.lora, self.model, self.arch, self.device, self.dtype, max_tokens)
        logger.info("LoRA: %d slots of rank %d on %d linear layers (%s)", self.config.lora.max_loras,
                    self.config.lora.max_lora_rank, len(set(self.lora.layers.values())),
                    "Triton gather kernels" if self.lora.state.use_triton else "torch reference")

    def _attach_w4_layer_tails(self, model: CausalLM) -> None:
        """One-token steps of eligible 4-bit layers run o_proj .. down_proj (and the next layer's
        qkv) as one persistent launch (kernels/w4_layer_tail.py): by default where it builds and
        its tiles fit (`why_not_auto`), MINIVLLM_W4_LAYER_TAIL=1 wherever eligible, 0 never. Not
        with LoRA (its adapters wrap the linears the tail replaces)."""
        from minivllm.kernels import w4_layer_tail
        mode = w4_layer_tail.mode()
        if mode == "0":
            return
        if self.lora is not None:
            logger.info("W4 layer tail: off with LoRA")
            return
        if mode == "auto":
            reason = w4_layer_tail.why_not_auto(model, self.config.cache.gpu_memory_utilization)
            if reason is not None:
                if reason != w4_layer_tail.NO_ELIGIBLE_LAYER:
                    logger.info("W4 layer tail: off (%s)", reason)
                return
        try:
            w4_layer_tail.attach_layer_tails(model)
        except RuntimeError as e:  # no nvcc, a failed build, no block fits: the unfused path serves
            logger.warning("W4 layer tail unavailable, decoding with the unfused kernels: %s", e)

    def _use_dense_gemv(self, model: CausalLM) -> None:
        """Steps of one or two rows (batch-1 decode): the decoder linears that the kept sweep
        found faster as minivllm's Triton GEMV than as cuBLAS take it (kernels/dense_gemv.py;
        MINIVLLM_DENSE_GEMV=1 forces every one, 0 none). Not in batch-invariant mode."""
        from minivllm.kernels.dense_gemv import gemv_mode, make_linears_gemv
        count = make_linears_gemv(model.layers)
        if count:
            logger.info("dense GEMV (%s): %d decoder linears take the Triton GEMV at <= 2 rows", gemv_mode(), count)

    def _fuse_fp8_activation_quant(self, model: CausalLM) -> None:
        """FP8 linears: the norms and SwiGLUs before them write quantized rows (kernels/fp8_act.py)."""
        if self.config.model.quantization is None:
            return
        from minivllm.kernels.fp8_act import enable_fused_activation_quant
        count = enable_fused_activation_quant(model.layers)
        if count:
            logger.info("FP8: %d activations quantized by the kernel that makes them", count)

    def _make_batch_invariant(self, model: CausalLM) -> None:
        """Batch-invariant mode (models/batch_invariant.py): on the GPU the fixed-tile matmul for
        every linear and the fixed-tile prefill kernel for every attention row; on the CPU
        setup_cpu_model has put everything on the compiled kernels (checked here)."""
        backend = model.layers[0].self_attn.backend
        if self.device.type == "cpu":
            from minivllm.models.cpu_linear import PackedLinear
            linears = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
            if getattr(backend, "_cpu_ops", None) is None or not all(
                    isinstance(m, PackedLinear) and m.panels is not None for m in linears):
                raise RuntimeError("batch_invariant on the CPU needs minivllm's compiled CPU kernels (the panel "
                                   "linear and the paged attention, kernels/cpu_kernels.py), which could not be "
                                   "loaded here (a C++ compiler and AVX2 are needed; see the log above)")
            logger.info("batch-invariant mode: %d linears on the panel kernel, attention on the CPU kernel",
                        len(linears))
            return
        from minivllm.models.batch_invariant import make_linears_batch_invariant
        if not hasattr(backend, "invariant"):
            raise RuntimeError(f"batch_invariant needs the triton attention backend on the GPU, got {backend.name!r}")
        backend.invariant = True
        logger.info("batch-invariant mode: %d linears on the fixed-tile Triton matmul, every attention row "
                    "through the fixed-tile prefill kernel", make_linears_batch_invariant(model))

    def setup_cpu_model(self, model: CausalLM) -> None:
        """CPU float32 only: linear layers on prepacked weights (models/cpu_linear.py: minivllm's
        panel kernel or oneDNN), the forward in fewer ops (models/cpu_forward.py) and the compiled
        kernels (kernels/cpu_kernels.py, built on first use and cached). For the target model and
        a speculative-decoding draft model alike."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return
        from minivllm.kernels import cpu_kernels
        from minivllm.models.cpu_forward import enable_cpu_forward
        from minivllm.models.cpu_linear import (AFFINE_MAX_ROWS, SCREEN_MAX_ROWS, PackedLinear, kernel_linear_preferred,
                                                pack_linears, packed_linear_available)
        backend = model.layers[0].self_attn.backend  # one instance serves every layer
        ops = None
        # the compiled attention and rotary + K/V store read and write float32 caches only: with an
        # FP8 cache they stay off (PyTorch ops, attention/torch_backend.py); the linears still use them
        fp32_cache = self.kv_dtype == torch.float32
        if cpu_kernels.kernel_enabled() and hasattr(backend, "use_cpu_kernel"):
            ops = cpu_kernels.load()
            if ops is not None and fp32_cache:
                backend.use_cpu_kernel(ops)
        # batch-invariant mode needs the panel kernel whatever the CPU (oneDNN blocks by shape)
        panel_kernel = ops is not None and ops.packed_panel_width() > 0 and packed_linear_available()
        if kernel_linear_preferred(ops) or (self.config.batch_invariant and panel_kernel):
            logger.info("CPU: %d linear layers on minivllm's packed-panel kernel (%s)",
                        pack_linears(model, ops=ops), ops.vector_isa())
            affine = sum(lin.prepare_affine_blocks() for lin in model.modules() if isinstance(lin, PackedLinear))
            if affine:
                logger.info("CPU: %d linear layers also as exact 4-bit affine blocks for steps of up to %d rows "
                            "(kernels/cpu/affine_block_linear.cpp)", affine, AFFINE_MAX_ROWS)
            lm_head = getattr(model, "lm_head", None)
            if isinstance(lm_head, PackedLinear) and lm_head.prepare_screened_argmax():
                logger.info("CPU: greedy tokens of up to %d rows through the LM head's int8 screen "
                            "(kernels/cpu/screened_argmax.cpp)", SCREEN_MAX_ROWS)
        elif packed_linear_available():
            logger.info("CPU: %d linear layers on prepacked oneDNN weights", pack_linears(model))
        # LoRA: the fused CPU forward calls the linears' kernels directly, past the LoRA layers: the
        # module path runs instead (its packed linears still apply, inside the LoRA layers)
        if self.config.lora is None and enable_cpu_forward(model, ops if fp32_cache else None):  # after packing: it binds the final linear modules
            logger.info("CPU: float32 forward in fewer ops (models/cpu_forward.py)%s",
                        ", fused C++ ops" if ops is not None else "")

    def init_kv_cache(self) -> int:
        """Size the KV cache from the memory budget, allocate it and hand it to the layers."""
        return self.allocate_kv_blocks(self.plan_kv_blocks())

    def plan_kv_blocks(self) -> int:
        """How many KV blocks this rank's budget holds (profiled on a GPU), without allocating."""
        return plan_num_blocks(self, self._bytes_per_block())

    def _bytes_per_block(self) -> int:
        """One block's K/V bytes on this rank (its layers, its KV heads), a draft model's included:
        a draft model's K/V share the target's block ids (spec_decode/model_proposer.py)."""
        draft = self._draft_model()
        per_block = bytes_per_block(self.model, self.block_size, self.kv_dtype)
        if draft is not None:
            per_block += bytes_per_block(draft, self.block_size, self.kv_dtype)
        return per_block

    def allocate_kv_blocks(self, num_blocks: int) -> int:
        """Allocate num_blocks blocks (every rank the same number: the executor takes the smallest
        a rank planned) and hand them to the layers; returns num_blocks."""
        draft, per_block = self._draft_model(), self._bytes_per_block()
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(self.model, self.num_blocks, self.block_size, self.kv_dtype, self.device)
        for layer, (k, v) in zip(self.model.layers, self.kv_caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
        if draft is not None:
            self.draft_kv_caches = allocate_kv_cache(draft, self.num_blocks, self.block_size, self.kv_dtype,
                                                     self.device)
            for layer, (k, v) in zip(draft.layers, self.draft_kv_caches):
                layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
        tokens = self.num_blocks * self.block_size
        if self.kv_dtype != self.dtype:  # the same bytes would hold this many tokens in the model's dtype
            same_bytes = tokens * per_block // bytes_per_block(self.model, self.block_size, self.dtype)
            logger.info("KV cache (%s, per-tensor scales): %d blocks of %d tokens = %d tokens (%d tokens in %s)",
                        str(self.kv_dtype).removeprefix("torch."), self.num_blocks, self.block_size, tokens,
                        same_bytes, self.config.model.dtype)
        else:
            logger.info("KV cache: %d blocks of %d tokens = %d tokens", self.num_blocks, self.block_size, tokens)
        return self.num_blocks

    def init_kv_transfer(self) -> HostKVTiers:
        """Host pools for swap preemption and the prefix cache's offload tier (sized in blocks of
        the whole KV cache, a draft model's included) and the copy engine that serves them."""
        from minivllm.kv_transfer.block_transfer import make_transfer_engine
        from minivllm.kv_transfer.cost import estimate_swap_costs
        pool = [t for kv in self.kv_caches + self.draft_kv_caches for t in kv]
        cache = self.config.cache
        self.kv_transfer, num_swap, num_offload = make_transfer_engine(pool, cache.swap_space_bytes,
                                                                       cache.kv_offloading_bytes)
        block_bytes = sum(t[0].numel() * t.element_size() for t in pool)
        if self.kv_transfer is not None:
            logger.info("KV in host memory: swap space %d blocks, offload tier %d blocks (%s a block)",
                        num_swap, num_offload, format_bytes(block_bytes))
        costs = estimate_swap_costs(sum(p.numel() for p in self.model.parameters()), block_bytes,
                                    self.device.type == "cuda")
        return HostKVTiers(num_swap, num_offload, block_bytes, costs)

    def init_kv_connector(self):
        """Disaggregated prefill/decode: the KV connector over this runner's KV cache (None: off)."""
        if self.config.kv_transfer is None:
            return None
        from minivllm.kv_transfer.connector import make_kv_connector
        return make_kv_connector(self.config.kv_transfer, [t for kv in self.kv_caches for t in kv])

    def _draft_model(self) -> CausalLM | None:
        """A separate draft model of speculative decoding (it needs a KV cache of its own)."""
        proposer = getattr(self.speculator, "proposer", None)
        model = getattr(proposer, "model", None)
        return model if model is not None and model is not self.model else None

    def capture_cuda_graphs(self) -> None:
        if self.config.enforce_eager or self.device.type != "cuda":
            return
        from minivllm.runner.cuda_graph import CudaGraphRunner
        t = time.perf_counter()
        reserved0 = torch.cuda.memory_reserved()
        # mixed-step graphs need an attention backend whose prefill launch depends on shapes only
        mixed = getattr(self.model.layers[0].self_attn.backend, "graph_safe_prefill", False)
        self.graphs = CudaGraphRunner(self, self.config.scheduler.max_num_seqs, mixed=mixed)
        self.graphs.capture()
        self.timings["cuda_graph_capture_s"] = time.perf_counter() - t
        graph_bytes = torch.cuda.memory_reserved() - reserved0
        report = getattr(self, "memory_report", None)
        if report is not None:
            report["cuda_graphs_measured"] = graph_bytes
        logger.info("captured %d CUDA graphs (decode: %d batch sizes, mixed steps: %d token sizes) in %.1f s; "
                    "they hold %s (planned: %s)", self.graphs.num_graphs, len(self.graphs.batch_sizes),
                    len(self.graphs.mixed_sizes), self.timings["cuda_graph_capture_s"], format_bytes(graph_bytes),
                    format_bytes(report["cuda_graph_reserve"]) if report else "not planned")

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Load now, not under the first requests, the kernels a step can need.

        - The Triton prefill kernel has one JIT variant per tile size, picked from the step's
          longest query (~1 s of compile each). Two sequences of q tokens for q = 2 .. 128 reach
          every tile size (q = 1, two one-token rows, also compiles the dense GEMV's variants).
          The dummy tokens go to the first KV blocks, all free at startup.
        - The LM head runs eagerly on the rows that sample, 1 .. max_num_seqs of them, and
          cuBLAS picks its kernel by the row count. With CUDA's lazy module loading (the
          default) a kernel's first use loads its module, and that waits for the device to go
          idle: a step launched behind a 100 ms step blocked the host for 100-220 ms, holding
          back the tokens of the step before it (W3 all at once; perf.md, session 5). So each
          row count runs once here (~1 s for Qwen3-8B)."""
        if self.device.type != "cuda" or self.parallel.rank.pp_size > 1:  # (a stage has no embedding or no head)
            return
        from minivllm.runner.profile import dummy_step_inputs
        t = time.perf_counter()
        for q in (1, 2, 4, 8, 16, 32, 64, 128):  # (q 1: two one-token rows, the dense GEMV's variants)
            inputs = dummy_step_inputs(2 * q, 2, self.block_size, self.device)
            self.model(inputs.input_ids, inputs.positions, inputs.meta)
        rows = torch.zeros(self.config.scheduler.max_num_seqs, self.arch.hidden_size, dtype=self.dtype,
                           device=self.device)
        # largest first, then empty_cache: each smaller logits tensor reuses the first one's
        # cached block. Smallest first, every step needed a bigger block than any cached one and
        # the allocator kept them all until the device was full (lease 8: a prefill instance
        # with an 8 GiB KV cache held 48 GiB, and the decode instance sharing its GPU found no
        # room; several models on one GPU would meet the same)
        for m in range(rows.shape[0], 0, -1):
            self.model.compute_logits(rows[:m])
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.timings["kernel_warmup_s"] = time.perf_counter() - t
        logger.info("warmed up the prefill kernels and the LM head in %.1f s", self.timings["kernel_warmup_s"])

    # ---- per-request state ------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        gone = sched.finished_req_ids | sched.preempted_req_ids
        for req_id in gone:
            self.requests.pop(req_id, None)
            self.block_rows.remove(req_id)
            self._sampled_at.pop(req_id, None)
        if self.speculator is not None and gone:
            self.speculator.drop(gone)
        for new in sched.new_requests:
            self.requests[new.req_id] = RunnerRequest([], _sampling_state(new, self._invariant_seed), new.lora_request,
                                                      new.pooling, new.beam_temperature)
            self.block_rows.set(new.req_id, [])
        copies = []
        rows = self.block_rows
        for s in sched.scheduled:
            table = self.requests[s.req_id].block_ids
            pair = _take_step_blocks(table, s)
            if pair is not None:  # a block replaced in place: the row is written again
                copies.append(pair)
                rows.set(s.req_id, table)
            elif s.new_block_ids:
                rows.extend(s.req_id, s.new_block_ids)
        if copies:
            self._copy_blocks(copies)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: every layer's K/V of block src into block dst (before the forward)."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for k, v in self.kv_caches:  # [num_blocks, block_size, Hk, D]
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.finish(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Queue the step's device work (forward, sampling, copy of the sampled ids to the host)
        and return without waiting for it."""
        return self.launch_sampling(self.launch_forward(sched))

    def prepare_forward(self, sched: SchedulerOutput) -> StepInputs | None:
        """The step's inputs, built on the host before the runner's request state takes the step
        in: so a constrained step can build the next step's inputs before its own sampling is
        queued (LLMEngine._pipeline_next). The block tables are the current ones plus the step's
        new blocks, as _update_states will make them (a new request starts from none)."""
        if sched.is_empty:
            return None
        fresh = {n.req_id for n in sched.new_requests}
        block_ids = {}
        for s in sched.scheduled:
            table = [] if s.req_id in fresh else list(self.requests[s.req_id].block_ids)
            _take_step_blocks(table, s)
            block_ids[s.req_id] = table
        return self._step_inputs(sched, block_ids)

    def _step_inputs(self, sched: SchedulerOutput, block_ids: dict[str, list[int]] | BlockTableRows) -> StepInputs:
        return build_step_inputs(sched.scheduled, block_ids, self.block_size, self.device,
                                 pin=self.device.type == "cuda")

    @torch.inference_mode()
    def launch_forward(self, sched: SchedulerOutput, inputs: StepInputs | None = None) -> ForwardStep:
        """Queue the step's forward only: the host can work out the step's grammar bitmask (it
        needs the previous step's tokens) while the device runs it. inputs: prepare_forward's,
        if built already."""
        self._update_states(sched)
        if sched.kv_transfers:  # block copies between the KV cache and host memory, before the forward
            self.kv_transfer.execute(sched.kv_transfers)
            self.kv_transfer.wait()
        if sched.is_empty:
            if getattr(self.model, "needs_idle_steps", False):  # replicas in lock-step: join the all_to_alls
                self.model.idle_step()
            return ForwardStep(None, [])
        if inputs is None:
            inputs = self._step_inputs(sched, self.block_rows)
        self._fill_placeholders(inputs)
        if self.lora is not None:
            self.lora.prepare_step([len(s.token_ids) for s in sched.scheduled],
                                   [self.requests[s.req_id].lora_request for s in sched.scheduled],
                                   inputs.input_ids.shape[0])
        extra = plan_extra_rows(sched.scheduled, inputs.request_starts, self.requests)
        hidden = self._forward(inputs, extra)
        if hidden is None:  # a pipeline stage before the last: its output went to the next stage
            return ForwardStep(None, [])
        num_sampling = inputs.logits_indices.shape[0]
        extras = self._extra_outputs(hidden[num_sampling:], extra)
        return ForwardStep(hidden[:num_sampling], inputs.sampling_req_ids, inputs, extras)

    def _output_rows(self, inputs: StepInputs, extra: ExtraRows | None) -> torch.Tensor:
        """The rows the forward returns: the sampling rows, then the extra rows."""
        if extra is None:
            return inputs.logits_indices
        return torch.cat([inputs.logits_indices, self._to_device(extra.rows)])

    def _extra_outputs(self, hidden: torch.Tensor, extra: ExtraRows | None):
        """(prompt logprobs, pooled vectors) of the step, on the host; (None, None) without any."""
        if extra is None:
            return None, None
        return prompt_logprobs(self.model, hidden, extra) or None, pool(hidden, extra, self.requests) or None

    @torch.inference_mode()
    def launch_sampling(self, fwd: ForwardStep, grammar: GrammarBitmask | None = None) -> LaunchedStep:
        """Queue the sampling of a forward, with the grammar's bitmask on its constrained rows."""
        if not fwd.req_ids:
            step = LaunchedStep([], [])
        elif self.speculator is not None and self.speculator.speculates(len(fwd.req_ids), fwd.inputs.draft_token_ids):
            step = self._run_speculative(fwd.hidden, fwd.inputs, grammar)
        else:
            step = self._launch_sampling(fwd.hidden, fwd.req_ids, grammar)
        step.prompt_logprobs, step.pooled = fwd.extras
        return step

    def _run_speculative(self, hidden: torch.Tensor, inputs: StepInputs,
                         grammar: GrammarBitmask | None = None) -> LaunchedStep:
        """Verify the step's drafts (every request's tokens on the host at once), then propose the
        next ones (spec_decode/speculator.py). Synchronous: the next step needs these results.
        A constrained request has no drafts (the scheduler gives it none): its one verify row
        gets its bitmask."""
        req_ids = inputs.sampling_req_ids
        states = [self.requests[r].sampling for r in req_ids]
        drafts = inputs.draft_token_ids or [[] for _ in req_ids]
        hook = None
        if grammar is not None:
            starts = itertools.accumulate((1 + len(d) for d in drafts[:-1]), initial=0)  # each request's first row
            rows = dict(zip(req_ids, starts))
            hook = functools.partial(self._apply_grammar_rows, rows=rows, grammar=grammar)
        step = self.speculator.verify(self.model, hidden, states, drafts, self.generator, logits_hook=hook)
        for state, tokens in zip(states, step.tokens):
            state.output_token_ids.extend(tokens)
        proposals = self.speculator.propose(req_ids, states, [self.requests[r].block_ids for r in req_ids],
                                            step.final_hidden)
        return LaunchedStep(req_ids, states, spec=RunnerOutput(req_ids, step.tokens, step.logprobs, proposals))

    def _fill_placeholders(self, inputs: StepInputs) -> None:
        """Tokens earlier steps sampled are not on the host yet: copy them on the device, one
        gather a source step (one in the usual case)."""
        if not inputs.placeholder_positions:
            return
        by_step: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for req_id, pos in zip(inputs.placeholder_req_ids, inputs.placeholder_positions):
            sampled, row = self._sampled_at[req_id]
            _, rows, positions = by_step.setdefault(id(sampled), (sampled, [], []))
            rows.append(row)
            positions.append(pos)
        for sampled, rows, positions in by_step.values():
            both = self._to_device(rows + positions)  # one copy
            inputs.input_ids[both[len(rows):]] = sampled[both[:len(rows)]]

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """Host ints to the device without waiting for queued work (pinned, non-blocking)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _forward(self, inputs: StepInputs, extra: ExtraRows | None = None) -> torch.Tensor | None:
        """This rank's part of the step's forward: the final hidden states of the sampling rows,
        then of the extra rows (prompt logprobs, pooling), on the last pipeline stage; None on an
        earlier one (its output went to the next stage)."""
        link, rank = self.parallel.pipeline, self.parallel.rank
        intermediate = None
        if link is not None and not rank.is_first_stage:
            intermediate = IntermediateTensors(*link.recv(inputs.input_ids.shape[0], self.arch.hidden_size,
                                                          self.dtype, self.device))
        if self._calibrate_kv_pending:  # calculate_kv_scales: this first real step sets the FP8 scales
            self._calibrate_kv_pending = False
            for layer in self.model.layers:
                layer.self_attn.calibrate_kv = True
            out = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                             output_rows=self._output_rows(inputs, extra), intermediate=intermediate)
        else:
            out = self._forward_sampling_rows(inputs, extra, intermediate)
        if isinstance(out, IntermediateTensors):
            link.send(out.hidden, out.residual)
            return None
        return out

    def _forward_sampling_rows(self, inputs: StepInputs, extra: ExtraRows | None = None,
                               intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """The final hidden states of the tokens that sample, then of the extra rows:
        [len(logits_indices) + len(extra.rows), H] (a stage before the last: every token's
        IntermediateTensors)."""
        graphs = self.graphs if intermediate is None else None
        hidden = graphs.try_run(inputs) if graphs is not None else None
        # as many logits rows as tokens: every token, in order (decode, or verify steps of drafts)
        every_token = extra is None and inputs.logits_indices.shape[0] == inputs.input_ids.shape[0]
        rows = None if every_token else self._output_rows(inputs, extra)
        if hidden is not None:
            return hidden if rows is None else hidden[rows]
        # only the sampling rows (the CPU forward then skips the last layer's work for the others)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, output_rows=rows, intermediate=intermediate)

    def _launch_sampling(self, hidden: torch.Tensor, req_ids: list[str],
                         grammar: GrammarBitmask | None = None) -> LaunchedStep:
        states = [self.requests[r].sampling for r in req_ids]
        # On the CPU a batch that only takes the argmax of the raw logits skips them: the LM head
        # folds the argmax into its kernel (models/cpu_linear.py; W5 decode: 0.9 ms a step of
        # ~11 ms for the LM head and argmax at 32 rows). Elsewhere the logits come first, as the
        # batch's device copies are queued behind them.
        logits = None if self.device.type == "cpu" else self.model.compute_logits(hidden)
        vocab_size = logits.shape[-1] if logits is not None else self.model.vocab_size
        batch = SamplingBatch.build(states, vocab_size, self.device, self.generator)
        if logits is None and batch.argmax_of_raw_logits and grammar is None:
            out = SamplerOutput(self.model.compute_greedy_tokens(hidden))
        else:
            if logits is None:
                logits = self.model.compute_logits(hidden)
            logits = self._beam_scaled(logits, req_ids)
            if grammar is not None:  # before sampling and logprobs: masked tokens get -inf
                self._apply_grammar(logits, req_ids, grammar)
            out = self.sampler(logits, batch)
        for state in states:
            state.num_pending += 1
        sampled_at, ids = self._sampled_at, out.sampled_token_ids
        for i, r in enumerate(req_ids):
            sampled_at[r] = (ids, i)
        if out.logprobs is not None or self.device.type != "cuda":
            return LaunchedStep(req_ids, states, host=out.to_host())  # one blocking copy
        host_buf = torch.empty(len(req_ids), dtype=torch.int64, pin_memory=True)
        host_buf.copy_(out.sampled_token_ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LaunchedStep(req_ids, states, host_buf=host_buf, event=event)

    def _beam_scaled(self, logits: torch.Tensor, req_ids: list[str]) -> torch.Tensor:
        """Beam search with temperature T ranks by log_softmax(logits / T): those rows are divided
        (a beam's token is the argmax, which division by T > 0 keeps)."""
        temps = [self.requests[r].beam_temperature or 1.0 for r in req_ids]
        if all(t == 1.0 for t in temps):
            return logits
        scale = torch.tensor([1.0 / t for t in temps], dtype=torch.float32, device=logits.device)
        return logits.float() * scale.unsqueeze(1)

    def _apply_grammar(self, logits: torch.Tensor, req_ids: list[str], grammar: GrammarBitmask) -> None:
        """logits [B, V] (fresh from the LM head, so changed in place): each constrained row
        keeps only the tokens its grammar allows."""
        self._apply_grammar_rows(logits, {r: i for i, r in enumerate(req_ids)}, grammar)

    def _apply_grammar_rows(self, logits: torch.Tensor, rows: dict[str, int], grammar: GrammarBitmask) -> None:
        """As _apply_grammar, with each constrained request's logits row given."""
        bitmask = grammar.bitmask
        if self.device.type == "cuda":
            bitmask = bitmask.to(self.device, non_blocking=True)  # pinned by the manager
        apply_token_bitmask(logits, bitmask, self._to_device([rows[r] for r in grammar.req_ids]))

    def finish(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step, take its tokens into the request state and return them (and
        logprobs) as plain data, with the MoE counts read since the last output."""
        self.take_in(step)
        out = self.step_output(step)
        counts = self.new_expert_counts()
        if counts is not None:  # new counts: they travel with this output
            out.expert_token_counts = counts
        return out

    def take_in(self, step: LaunchedStep) -> None:
        """Wait for a launched step and append its sampled tokens to its requests' sampling state
        (the next launches read it). Once per step, in launch order, on the thread that launches."""
        self.expert_counts.poll()
        if not step.req_ids or step.spec is not None:  # (speculative steps took theirs in at launch)
            return
        for state, tok in zip(step.states, _host_output(step).sampled_token_ids):
            state.output_token_ids.append(tok)
            state.num_pending -= 1

    def step_output(self, step: LaunchedStep) -> RunnerOutput:
        """A launched step's tokens (and logprobs, prompt logprobs, pooled vectors) as plain data,
        once its device work is done. Changes no request state, so an mp driver rank builds it on
        its reply thread while the main thread launches the next step (executor/worker.py)."""
        if not step.req_ids:
            out = RunnerOutput([], [])
        elif step.spec is not None:
            out = step.spec
        else:
            host = _host_output(step)
            out = RunnerOutput(step.req_ids, [[t] for t in host.sampled_token_ids], _token_logprobs(step.states, host))
        out.prompt_logprobs, out.pooled = step.prompt_logprobs, step.pooled
        return out

    def new_expert_counts(self) -> list[list[int]] | None:
        """A MoE model's per-layer expert counts if published since the last call (else None):
        each publication travels with one output."""
        if self.expert_counts.version == self._counts_sent:
            return None
        self._counts_sent = self.expert_counts.version
        return self.expert_counts.latest_per_layer

    # ---- profiling helpers ----------------------------------------------------------------
    @torch.inference_mode()
    def dummy_forward(self, num_tokens: int, num_seqs: int) -> int:
        """A forward pass (and sampling) over num_tokens tokens split into num_seqs prompts, on a
        temporary KV cache; measures peak activation memory before the real cache exists.
        Returns the peak allocated bytes of the forward alone (what a CUDA graph of the step
        holds), before the LM head and sampling (CUDA only; 0 elsewhere)."""
        from minivllm.runner.profile import dummy_step_inputs
        inputs = dummy_step_inputs(num_tokens, num_seqs, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                            intermediate=self._dummy_intermediate(inputs.input_ids.shape[0]))
        forward_peak = torch.cuda.max_memory_allocated() if self.device.type == "cuda" else 0
        if isinstance(hidden, IntermediateTensors):  # a pipeline stage before the last
            return forward_peak
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        states = [SamplingRequestState(_profile_params(), [0], [], frozenset(), 0) for _ in range(num_seqs)]
        self.sampler(logits, SamplingBatch.build(states, logits.shape[-1], self.device, self.generator))
        return forward_peak

    def _dummy_intermediate(self, num_tokens: int) -> IntermediateTensors | None:
        """What a later pipeline stage starts a synthetic step from (zeros; None on the first)."""
        if self.parallel.rank.is_first_stage:
            return None
        zeros = torch.zeros(num_tokens, self.arch.hidden_size, dtype=self.dtype, device=self.device)
        return IntermediateTensors(zeros, zeros.clone())


def _take_step_blocks(table: list[int], s) -> tuple[int, int] | None:
    """A request's block table takes its step's new blocks, and a shared, partly filled block is
    replaced by this request's copy of it (copy-on-write): (src, dst) of that copy, or None."""
    table.extend(s.new_block_ids)
    if s.cow is None:
        return None
    index, src, dst = s.cow
    table[index] = dst
    return src, dst


def _host_output(step: LaunchedStep) -> HostSamplerOutput:
    """The step's sampled ids on the host, waiting for their copy. An mp driver's two threads
    (take_in, step_output) may both get here first: each reads the same completed buffer, so
    whichever list is stored, they are equal."""
    if step.host is None:
        step.event.synchronize()
        step.host = HostSamplerOutput(step.host_buf.tolist())
    return step.host


def _token_logprobs(states: list[SamplingRequestState], host: HostSamplerOutput) -> list[list[TokenLogprobs] | None] | None:
    if host.logprobs is None:
        return None
    out = []
    for i, s in enumerate(states):
        k = s.params.logprobs
        out.append(None if k is None else [TokenLogprobs(
            host.logprob_token_ids[i][:1 + k], host.logprobs[i][:1 + k], host.sampled_ranks[i])])
    return out


def _sampling_state(new: NewRequestData, engine_seed: int | None = None) -> SamplingRequestState:
    """engine_seed (batch-invariant mode): an unseeded random request gets a seed of its own, so
    its noise comes from the per-row counter-based stream, not a batch-wide draw."""
    params = new.sampling_params
    if engine_seed is not None and params.seed is None and not params.greedy:
        from minivllm.models.batch_invariant import request_seed
        params = params.clone()
        params.seed = request_seed(engine_seed, new.req_id)
    return SamplingRequestState(
        params=params,
        prompt_token_ids=new.prompt_token_ids,
        output_token_ids=list(new.output_token_ids),
        eos_token_ids=new.eos_token_ids,
        sample_index=new.sample_index,
    )


def _profile_params():
    from minivllm.sampling_params import SamplingParams
    return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)
