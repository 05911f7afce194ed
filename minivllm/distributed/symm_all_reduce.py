"""All-reduce of decode-sized activations through torch's symmetric memory (the "custom
all-reduce" of vLLM's engine, here torch.distributed._symmetric_memory's kernels).

Why: a decode step of a tensor-parallel model makes two all-reduces a layer of [batch, hidden]
activations (8 KB at batch 1, 2 MB at batch 256 on an 8B model). NCCL's ring spends most of
its ~15-25 us on latency at those sizes; a kernel that reads every peer's buffer straight over
NVLink (one barrier before, one after) spends a few us.

How: each rank of the TP group allocates one buffer of `max_bytes` with symm_mem.empty and
rendezvouses it (peers map each other's buffer). An all-reduce of x (contiguous, bf16 or
fp32, at most max_bytes):
  - one-shot (x at most one_shot_max bytes): one kernel copies x into this rank's buffer,
    waits for every peer to do the same, then sums the ranks' buffers and writes x;
  - two-shot (larger): x is copied into the buffer, then each rank sums 1/world of the
    elements from every buffer and the ranks gather the sums (less read per rank at ws >= 4).
Larger messages (prefill) and other dtypes go to NCCL.

Invariant kept from the NCCL path: every rank gets the same bits. torch's kernels sum the
ranks' vectors in rank order (load_and_reduce, specialised for world sizes 2, 4 and 8), not
starting from the own rank, so replicated work after the reduce (norms, MoE routing,
sampling from gathered logits) stays identical across ranks. Other world sizes are refused
here (NCCL serves them).

Graph safety: every call uses the same buffer and barriers on the current stream, so the
kernels capture into CUDA graphs like any other; the rendezvous (a collective) happens once,
at startup, before any capture.

Off: LLM(disable_custom_all_reduce=True) / --disable-custom-all-reduce (vLLM's names), or
MINIVLLM_CUSTOM_ALL_REDUCE=0. MINIVLLM_CUSTOM_ALL_REDUCE_ONE_SHOT_MAX (bytes) moves the
one-shot / two-shot threshold."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MiB = 1 << 20
SUPPORTED_WORLD_SIZES = (2, 4, 8)  # torch's kernels fix the summation order for these
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)  # what torch's symm-mem all-reduce dispatches
DEFAULT_MAX_BYTES = 8 * MiB  # covers decode steps in CUDA graphs (512 rows x 5120 x 2 B = 5 MB)
# one-shot reads (world - 1) x the message from peers; two-shot about 2 x message / world.
# 2 H200s (all_reduce_bench, 2026-11-28, us a call in CUDA graphs, one-shot / two-shot / NCCL):
# 1 MiB 14.6 / 15.5 / 21.4, 2 MiB 21.5 / 19.1 / 34.0, 8 MiB 61.9 / 41.5 / 52.2
DEFAULT_ONE_SHOT_MAX = {2: 1 * MiB, 4: 512 * 1024, 8: 256 * 1024}
ALIGN_BYTES = 16  # the kernels' widest vector: start and size multiples of it keep them on 16-byte loads


def enabled_by_env() -> bool:
    return os.environ.get("MINIVLLM_CUSTOM_ALL_REDUCE", "1") != "0"


class SymmetricAllReduce:
    """One rank's side of the symmetric-memory all-reduce of one TP group."""

    def __init__(self, group: dist.ProcessGroup, world_size: int, device: torch.device,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem
        self.group_name = group.group_name
        self.world_size = world_size
        self.max_bytes = max_bytes
        env = os.environ.get("MINIVLLM_CUSTOM_ALL_REDUCE_ONE_SHOT_MAX")
        self.one_shot_max = int(env) if env else DEFAULT_ONE_SHOT_MAX[world_size]
        _use_cuda_backend(symm_mem, self.group_name)
        # one byte buffer, viewed as each dtype; rendezvous is collective over the group
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.calls = {"one_shot": 0, "two_shot": 0}  # eager-time counts, for tests and logs

    def can_reduce(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in SUPPORTED_DTYPES and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and x.data_ptr() % ALIGN_BYTES == 0 and nbytes % ALIGN_BYTES == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group into x (in place); the caller checked can_reduce(x)."""
        return self._reduce(x, x.numel() * x.element_size() <= self.one_shot_max)

    def _reduce(self, x: torch.Tensor, one_shot: bool) -> torch.Tensor:
        flat = x.view(-1)
        staged = self.buffer.view(x.dtype)[:flat.numel()]
        if one_shot:  # one kernel: copy in, barrier, sum the peers' buffers into x, barrier
            self.calls["one_shot"] += 1
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)
        else:  # copy in; then reduce-scatter and all-gather through the buffers, out into x
            self.calls["two_shot"] += 1
            staged.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x

    def self_check(self, rank: int) -> bool:
        """Both kernels on a known message: rank r contributes r + 1 + i % 7 at element i, so the
        sum is exact in bf16 and fp32 (small integers). A collective: every rank calls it."""
        for dtype in SUPPORTED_DTYPES:
            for one_shot in (True, False):
                i = torch.arange(4096, device=self.buffer.device)
                x = (rank + 1 + i % 7).to(dtype)
                want = (self.world_size * (self.world_size + 1) // 2 + self.world_size * (i % 7)).to(dtype)
                if not torch.equal(self._reduce(x, one_shot), want):
                    return False
        self.calls = {"one_shot": 0, "two_shot": 0}
        return True


def _use_cuda_backend(symm_mem, group_name: str) -> None:
    """CUDA's own peer mappings (cuMem handles over a Unix socket, as NCCL's), not NVSHMEM, which
    needs its own bootstrap; and, on torch versions that still want it, the group enabled."""
    import warnings
    if hasattr(symm_mem, "set_backend"):
        try:
            symm_mem.set_backend("CUDA")
        except Exception:  # noqa: BLE001 - already set by an earlier allocation of this process
            pass
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (a no-op) on newer torch
            symm_mem.enable_symm_mem_for_group(group_name)


def build(group: dist.ProcessGroup | None, world_size: int, device: torch.device,
          disabled: bool) -> SymmetricAllReduce | None:
    """The group's symmetric-memory all-reduce, or None (NCCL serves every all-reduce): off by
    the config or the environment, not CUDA, a world size torch's kernels do not specialise,
    or symmetric memory unavailable here (logged once with the reason)."""
    if disabled or not enabled_by_env() or group is None or device.type != "cuda":
        return None
    if world_size not in SUPPORTED_WORLD_SIZES:
        logger.info("custom all-reduce: off for a TP group of %d ranks (torch's kernels: %s); NCCL instead",
                    world_size, SUPPORTED_WORLD_SIZES)
        return None
    comm, why = None, ""
    try:
        comm = SymmetricAllReduce(group, world_size, device)
        if not comm.self_check(dist.get_rank(group)):
            comm, why = None, "its self-check summed wrong"
    except Exception as e:  # noqa: BLE001 - any failure to map the peers' memory falls back to NCCL
        comm, why = None, f"{type(e).__name__}: {e}"
    # every rank of the group must take the same path, or one waits in a collective forever
    ok = torch.tensor([0 if comm is None else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not int(ok.item()):
        logger.warning("custom all-reduce: symmetric memory unavailable (%s); NCCL serves every all-reduce",
                       why or "another rank of the group could not use it")
        return None
    logger.info("custom all-reduce: symmetric memory, %d ranks, messages up to %d bytes (one-shot up to %d)",
                world_size, comm.max_bytes, comm.one_shot_max)
    return comm
