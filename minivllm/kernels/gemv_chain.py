"""Experimental (issue 25, not used by the engine): a chain of batch-1 W4A16 GEMVs in ONE persistent
launch, each GEMV's input the previous one's output, with a grid-wide barrier between them instead
of a kernel boundary. It measures whether the ~4-5 us that each GEMV of a decode step spends above
its bytes (docs/perf.md, lease 36) goes away without kernel boundaries: the question a persistent
decode-layer kernel (norms, rotary, attention, GEMVs in one launch) has to answer first.

    grid = (programs,)   programs <= the GPU's resident capacity: every program must be running at
                         once, or the barrier never opens (gemv_chain_launch checks it)

Per stage s (one GEMV: meta row s = qweight, scales, zeros, x, out addresses, N, K):
  1. ask L2 for the first K steps of this program's first work item of stage s (weights: nothing
     in the chain writes them, so this may run before the previous stage has finished);
  2. wait until every program has arrived from stage s - 1 (the barrier's acquire);
  3. the work items pid, pid + programs, ...: item i = (output tile i // SPLIT_K, K slice
     i % SPLIT_K), each the GEMV kernel's own K loop (w4a16_gemm._w4a16_gemv_pipelined) and its
     split-K fix-up (split_k.store_tile), so every stage's output has the separate kernel's bits;
  4. arrive (the barrier's release: this program's stores, and its fix-ups', are published).

The barrier is one int32 counter, 0 at launch (the caller zeroes it), that each program increments
once per stage; stage s waits for programs * s arrivals. A wait gives up after MAX_POLLS reads and
flags it (`_wait`): a grid too large to be resident ends with the flag set instead of hanging.
Under Triton's interpreter programs run one after another, so there a grid of one program runs
the chain and a grid of two exercises the give-up (tests/unit/test_gemv_chain_interpret.py).
scripts/bench_gemv_chain.py times it on the GPU against the same GEMVs as separate launches in a
CUDA graph with PDL (the engine's way) and checks that both give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import prefetch_l2
from minivllm.kernels.split_k import store_tile, tile_counters
from minivllm.kernels.w4a16_gemm import _w4a16_gemv_pipelined
from minivllm.quant import w4

# a stage's row of the table: qweight, scales, zeros, x, out (addresses), N, K, unused
META_FIELDS: tl.constexpr = tl.constexpr(8)


@triton.jit
def _arrive(bar_ptr):
    """This program is done with the stage: every thread's stores before the increment (CTA
    barrier, then a release at gpu scope)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release")


@triton.jit
def _poll(bar_ptr, ASM: tl.constexpr):
    """The arrivals counted so far, read with acquire semantics. ASM (the GPU): a plain acquire
    load, which does not queue behind the arrivals' atomics at L2 as a spinning read-modify-write
    would; else (Triton's interpreter, which has no inline assembly) an atomic add of 0."""
    if ASM:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
                                         [bar_ptr.to(tl.int64, bitcast=True)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.atomic_add(bar_ptr, 0, sem="acquire")


@triton.jit
def _wait(bar_ptr, target, ASM: tl.constexpr, MAX_POLLS: tl.constexpr):
    """Until `target` arrivals have been counted (the arrived programs' stores are then visible).
    A barrier that does not open within MAX_POLLS reads (programs that are not all resident)
    sets the flag after the counter (bar_ptr + 1) and lets the program go on, and every later wait
    of the launch is skipped: the launch ends, with wrong results and the flag set, instead of
    hanging the GPU (GemvChain.timed_out)."""
    if tl.load(bar_ptr + 1, volatile=True) == 0:
        polls = 0
        seen = _poll(bar_ptr, ASM)
        while (seen < target) & (polls < MAX_POLLS):
            seen = _poll(bar_ptr, ASM)
            polls += 1
        if seen < target:
            tl.atomic_xchg(bar_ptr + 1, 1)
    tl.debug_barrier()


@triton.jit
def _gemv_chain_kernel(meta_ptr, bar_ptr, ws_ptr, cnt_ptr, n_stages,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       HALF2: tl.constexpr, EVEN: tl.constexpr, PREFETCH_STEPS: tl.constexpr,
                       MAX_POLLS: tl.constexpr):
    """HALF2: the GPU (packed half2 math with paired activation loads, as the engine's GEMV; the
    spin on an acquire load); else the plain math and an atomic spin (Triton's interpreter).
    EVEN: every stage's N and K are multiples of BLOCK_N and BLOCK_K (no masks)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rw = tl.arange(0, BLOCK_K // 8)
    for s in range(n_stages):
        row = meta_ptr + s * META_FIELDS
        qw_ptr = tl.load(row + 0).to(tl.pointer_type(tl.int32))
        sc_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float16))
        z_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float16))
        x_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float16))
        out_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float16))
        N = tl.load(row + 5).to(tl.int32)
        K = tl.load(row + 6).to(tl.int32)
        tiles = tl.cdiv(N, BLOCK_N)
        per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        if PREFETCH_STEPS > 0:  # the first item's first K steps, before the wait (weights only)
            if pid < tiles * SPLIT_K:
                first_word = (pid % SPLIT_K) * per_split * (BLOCK_K // 8)
                pw = tl.minimum(first_word + tl.arange(0, PREFETCH_STEPS * (BLOCK_K // 8)), K // 8 - 1)
                pc = tl.minimum((pid // SPLIT_K) * BLOCK_N + tl.arange(0, BLOCK_N // 32) * 32, N - 1)
                prefetch_l2(qw_ptr + pw[:, None] * N + pc[None, :])
        _wait(bar_ptr, programs * s, HALF2, MAX_POLLS)
        for item in range(pid, tiles * SPLIT_K, programs):
            pid_n = item // SPLIT_K
            pid_k = item % SPLIT_K
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N
            t_end = tl.minimum((pid_k + 1) * per_split, tl.cdiv(K, BLOCK_K))
            acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
            acc = _w4a16_gemv_pipelined(acc, x_ptr, qw_ptr, sc_ptr, z_ptr, 0, rn, rw, n_ok, K, pid_k * per_split,
                                        t_end, 0, 1, N, 1, N, 1, GROUP, BLOCK_N, BLOCK_K, HALF2, EVEN, False, HALF2)
            out = tl.sum(acc, 0)
            if HALF2:
                out = out * 16.0  # (the packed products' 1/16, as in _w4a16_gemv_kernel)
            store_tile(out, out_ptr, ws_ptr, cnt_ptr, rn, rn, N, n_ok, pid_k, pid_n, SPLIT_K)
        _arrive(bar_ptr)


Stage = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # qweight, scales, zeros, x, out


def chain_meta(stages: list[Stage]) -> torch.Tensor:
    """int64 [len(stages), META_FIELDS] for (qweight [K/8, N], scales, zeros [K/G, N], x [>= K],
    out [N]) per stage, all float16 but qweight, contiguous, on one device; the tensors must
    outlive every launch that reads the table."""
    rows = []
    for qw, sc, z, x, out in stages:
        k, n = qw.shape[0] * 8, qw.shape[1]
        assert sc.shape == z.shape and sc.shape[1] == n and x.numel() >= k and out.numel() == n, (qw.shape, x.shape)
        assert all(t.is_contiguous() for t in (qw, sc, z, x, out))
        assert sc.dtype == z.dtype == x.dtype == out.dtype == torch.float16
        rows.append([qw.data_ptr(), sc.data_ptr(), z.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, 0])
    return torch.tensor(rows, dtype=torch.int64, device=stages[0][0].device)


def random_stages(shapes: list[tuple[int, int]], group: int, device, seed: int = 0) -> list[Stage]:
    """Random float16 chain stages of (N, K) on `device` (the test's and the benchmark's data):
    stage i reads stage i - 1's output (its first K values), stage 0 a random x; each out starts
    NaN, so an element no program wrote shows. Scales shrink with sqrt(K): values stay O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    prev = torch.randn(shapes[0][1], generator=g, device=device).half()
    stages = []
    for n, k in shapes:
        assert prev.numel() >= k, "a stage reads more values than the one before it wrote"
        q = torch.randint(0, 16, (k, n), generator=g, device=device)
        scales = ((torch.rand(k // group, n, generator=g, device=device) * 0.02 + 0.002) * (256 / k) ** 0.5).half()
        zeros = torch.randint(0, 16, (k // group, n), generator=g, device=device).half()
        out = torch.full((n,), float("nan"), dtype=torch.float16, device=device)
        stages.append((w4.pack_engine(q).contiguous(), scales, zeros, prev, out))
        prev = out
    return stages


class GemvChain:
    """One launch of the whole chain: meta (chain_meta), a barrier counter, the split-K workspace
    and tile counters sized for its largest stage. __call__ zeroes the counter and launches (both
    capturable in a CUDA graph); on the GPU the first call compiles and refuses a grid larger
    than what can be resident at once."""

    def __init__(self, meta: torch.Tensor, max_n: int, programs: int, group: int = 128, block_n: int = 32,
                 block_k: int = 256, split_k: int = 4, half2: bool = True, even: bool = False,
                 prefetch_steps: int = 1, num_warps: int = 4, max_polls: int = 1 << 22):
        self.meta, self.programs = meta, programs
        device = meta.device
        self.bar = torch.zeros(2, dtype=torch.int32, device=device)  # arrivals, timed-out flag
        self.ws = torch.empty(split_k * max_n, dtype=torch.float32, device=device)
        self.cnt = tile_counters(device, triton.cdiv(max_n, block_n))
        self.kw = dict(GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, HALF2=half2, EVEN=even,
                       PREFETCH_STEPS=prefetch_steps if device.type == "cuda" else 0,  # (inline PTX)
                       MAX_POLLS=max_polls, num_warps=num_warps)
        self.checked = device.type != "cuda"

    def _args(self):
        return self.meta, self.bar, self.ws, self.cnt, self.meta.shape[0]

    def __call__(self) -> None:
        if not self.checked:
            limit = self.resident_limit()
            if self.programs > limit:
                raise ValueError(f"gemv chain: {self.programs} programs, but only {limit} fit on the GPU at once")
            self.checked = True
        self.bar.zero_()
        _gemv_chain_kernel[(self.programs,)](*self._args(), **self.kw)

    def timed_out(self) -> bool:
        """Whether a barrier of the last launch gave up waiting (its results are then wrong)."""
        return bool(self.bar[1].item())

    def resident_limit(self) -> int:
        """How many programs of the compiled kernel fit on the GPU at once (registers, shared
        memory, threads per SM): the most `programs` may be without the barrier waiting forever."""
        kernel = _gemv_chain_kernel.warmup(*self._args(), grid=(1,), **self.kw)
        if hasattr(kernel, "_init_handles"):
            kernel._init_handles()
        props = torch.cuda.get_device_properties(self.meta.device)
        threads = 32 * self.kw["num_warps"]
        # (Hopper's figures where this torch's properties lack a field)
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, kernel.n_regs * threads)
        shared = kernel.metadata.shared
        by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // shared if shared else 32
        by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
        return props.multi_processor_count * max(0, min(by_regs, by_smem, by_threads, 32))
