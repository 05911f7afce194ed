"""The CPU float32 kernels in C++ (`kernels/cpu/`), built at first use:

- `paged_decode_attention.cpp`: decode attention reading each row's K/V blocks where they lie.
  The plain-PyTorch backend copies them out with `index_select` in every layer, then runs SDPA
  over the copy: ~40 ms of a ~120 ms decode step of W5's 32-request batch (docs/perf.md).
- `fused_ops.cpp`: residual add + RMSNorm, rotary + K/V store, SiLU-and-multiply, one call each
  instead of ~25 small PyTorch ops a layer (models/cpu_forward.py).

Building: `torch.utils.cpp_extension.load` compiles the sources with the system C++ compiler and
ninja (~20 s once; the library is cached under torch's extensions directory, by default
~/.cache/torch_extensions, and reused by later processes). On an x86 CPU it is built for the
widest vector ISA the CPU reports, AVX-512 (`-mavx512f`) or AVX2 + FMA (`-mavx2 -mfma`), and
takes the vectorized paths; elsewhere the portable ones. If the build
fails (no compiler), `load()` logs why once and returns None, and the engine keeps the
plain-PyTorch path. MINIVLLM_CPU_KERNELS=0 switches the kernels off.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_FLAG = "MINIVLLM_CPU_KERNELS"
SOURCE_DIR = Path(__file__).with_name("cpu")
SOURCES = [SOURCE_DIR / "paged_decode_attention.cpp", SOURCE_DIR / "fused_ops.cpp", SOURCE_DIR / "packed_linear.cpp",
           SOURCE_DIR / "screened_argmax.cpp", SOURCE_DIR / "affine_block_linear.cpp"]
_loaded: dict[str, object] = {}  # variant -> op namespace, or None when its build failed


def kernel_enabled() -> bool:
    return os.environ.get(ENV_FLAG, "1") != "0"


# variant -> compiler flags; each variant is built only where the CPU reports its ISA
VARIANT_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512dq", "-mfma", "-mavx2"],
    "avx2": ["-mavx2", "-mfma", "-mno-avx512f"],
    "portable": ["-mno-avx512f"],  # the portable path even where the compiler defaults to AVX-512
}


def cpuinfo_field(name: str) -> str:
    """The first value of `name` in Linux's /proc/cpuinfo ("flags", "vendor_id"); "" elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    """The x86 CPU's feature flags (empty off Linux or x86)."""
    return set(cpuinfo_field("flags").split())


def runnable_variants() -> list[str]:
    """The variants this CPU can run, widest first; "portable" always."""
    flags = _cpu_flags()
    out = []
    if "avx512f" in flags:
        out.append("avx512")
    if {"avx2", "fma"} <= flags:
        out.append("avx2")
    return out + ["portable"]


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; a venv used without activation has it only in the
    ninja package's own directory."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # the PyPI package that ships the binary
        candidates.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for d in candidates:
        if (d / "ninja").exists():
            os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
            return


# A build takes ~20-70 s. A build lock older than this was left by a process killed while
# building (torch's cpp_extension would then wait for it forever, hanging every later start).
STALE_LOCK_S = 300.0


def _wait_for_build_lock(build_dir: Path, stale_after: float = STALE_LOCK_S, poll: float = 1.0) -> None:
    """Wait while another process holds `build_dir`'s build lock; remove the lock once it is older
    than `stale_after` seconds, so an interrupted build is redone instead of waited on."""
    lock = build_dir / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            logger.warning("CPU kernels: removing a build lock %.0f s old (%s): an earlier build was interrupted; "
                           "building again", age, lock)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll)


def load(variant: str | None = None):
    """Build (first time) and load the kernel; returns its op namespace or None.

    variant: "avx512", "avx2" or "portable"; None picks the widest this CPU runs. Each variant is
    its own library and op namespace (`torch.ops.minivllm_cpu_<variant>`), so tests can load
    every one."""
    if variant is None:
        variant = runnable_variants()[0]
    if variant not in VARIANT_FLAGS:
        raise ValueError(f"variant must be one of {sorted(VARIANT_FLAGS)}, got {variant!r}")
    if variant in _loaded:
        return _loaded[variant]
    namespace = f"minivllm_cpu_{variant}"
    flags = ["-O3", "-fopenmp", f"-DMINIVLLM_OPS_NAMESPACE={namespace}"]
    # explicit ISA flags rather than -march=native: the cached library then runs on any CPU
    # with that ISA, not only on the exact model that built it
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += VARIANT_FLAGS[variant]
    t = time.perf_counter()
    try:
        from torch.utils import cpp_extension
        _ensure_ninja_on_path()
        _wait_for_build_lock(Path(cpp_extension._get_build_directory(namespace, verbose=False)))
        # -fopenmp only compiles at::parallel_for's pragmas: the link line has no -lgomp, so the
        # library uses the OpenMP runtime torch already loaded (one thread pool, not two)
        cpp_extension.load(name=namespace, sources=[str(p) for p in SOURCES], extra_cflags=flags,
                           extra_include_paths=[str(SOURCE_DIR)], is_python_module=False, verbose=False)
        ops = getattr(torch.ops, namespace)
    except Exception as e:  # no compiler, no ninja, a failed build: keep the PyTorch path
        logger.warning("CPU kernels unavailable (%s: %s); using the plain-PyTorch path",
                       type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        ops = None
    else:
        logger.info("CPU kernels (%s) ready in %.1f s", variant, time.perf_counter() - t)
    _loaded[variant] = ops
    return ops


def check_decode_rows(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise ValueError unless every decode row reads 1 .. len keys from blocks that exist.

    The kernels never see a bad index: a C++ exception crossing the op boundary crashed the
    process under one torch build (2.11 on the GPU machine), so the checks are made here, in
    Python, once per step (not per layer), and the C++ checks are only a second line."""
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if seq_lens.numel() == 0:
        return
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    needed = -(-hi // block_size)
    if lo < 1 or needed > block_tables.shape[1]:
        raise ValueError(f"seq_lens must lie in [1, {block_tables.shape[1] * block_size}], got [{lo}, {hi}]")
    ids = block_tables[:, :needed]  # unused table entries are 0, a valid id
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got [{int(ids.min())}, {int(ids.max())}]")


def check_rope_store(positions: torch.Tensor, slot_mapping: torch.Tensor, max_positions: int, num_slots: int) -> None:
    """Raise ValueError unless every position has a rotary entry and every slot (or -1) exists."""
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    if positions.numel() == 0:
        return
    if int(positions.min()) < 0 or int(positions.max()) >= max_positions:
        raise ValueError(f"positions must lie in [0, {max_positions}), got [{int(positions.min())}, "
                         f"{int(positions.max())}]")
    if int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot_mapping must lie in [-1, {num_slots}), got [{int(slot_mapping.min())}, "
                         f"{int(slot_mapping.max())}]")


def paged_decode_attention(ops, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           checked: bool = False) -> torch.Tensor:
    """query [B, Hq, D] (heads contiguous), caches [N, bs, Hk, D], block_tables [B, M] int32,
    seq_lens [B] int32 -> [B, Hq, D]: row b attends to keys 0 .. seq_lens[b] - 1.
    checked: the caller already ran check_decode_rows on these tables this step."""
    if not supports(query, k_cache) or v_cache.shape != k_cache.shape or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous() or block_tables.shape[0] != query.shape[0] \
            or seq_lens.shape != (query.shape[0],):
        raise ValueError("paged_decode_attention: float32 CPU query [B, Hq, D] with contiguous heads, contiguous "
                         "caches [N, bs, Hk, D] with Hq a multiple of Hk, one table row and length per query row")
    if not checked:
        check_decode_rows(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
    out = torch.empty(query.shape, dtype=query.dtype)
    ops.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens.contiguous(), scale, out)
    return out


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer's decode rows."""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and k_cache.dtype == torch.float32
            and query.dim() == 3 and k_cache.dim() == 4 and query.shape[2] == k_cache.shape[3]
            and query.shape[1] % k_cache.shape[2] == 0 and query.stride(2) == 1
            and query.stride(1) == query.shape[2])
