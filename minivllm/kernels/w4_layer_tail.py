"""The W4A16 layer tail: o_proj, add + RMSNorm, gate_up, SiLU-and-mul and down_proj of one decode
token in one persistent CUDA launch (kernels/cuda/w4_layer_tail.cu), for batch-1 decode of 4-bit
models on Hopper GPUs.

Why: at batch 1 a decoder layer is nine short launches, and each boundary between two of them
leaves the memory idle for a few microseconds; the tail's five are 81 % of a layer's weight bytes
(Llama-3.1-8B). One persistent launch streams their weights with bulk copies into a shared-memory
ring that runs ahead of the waits between its stages (docs/perf.md, 2026-11-29: the prototype
scripts/persistent_gemv/chain.cu).

Switch: MINIVLLM_W4_LAYER_TAIL: by default ("auto") on where nvcc is found and the tiles take at
most 10 % of the engine's GPU memory (`why_not_auto`); 1 on wherever eligible, 0 off. The runner attaches
a tail to every eligible decoder layer after loading (`attach_layer_tails`); DecoderLayer takes it for steps of exactly one
token. Eligible: a CUDA device of compute capability 9.0, float16 activations, W4A16 o_proj,
gate_up_proj and down_proj with group size 128, no act-order permutation and no bias, every input
width a multiple of 2,048 up to 16,384, no tensor parallelism, no LoRA. Where every layer is eligible (and its
qkv_proj too), a tail also runs the next layer's input norm and qkv projection: a one-token step
is then two launches a layer, attention and the tail (CausalLM.forward_tails). Where that layer's
attention takes the Triton rotary path into fp16 caches (`rope_target`), the qkv stage's epilogue
also rotates q and k and stores K and V in the cache, so its attention skips the rotary kernel
(MINIVLLM_W4_TAIL_ROPE=0: not; measured neutral in time, one launch a layer less, docs/perf.md). The weights are
kept a second time in the tile format (quant/w4_tiles.py): the four projections again (3.7 GB
for Llama-3.1-8B).

The kernel is compiled on first use with nvcc (CUDA_HOME, /usr/local/cuda or PATH) into
~/.cache/minivllm (MINIVLLM_CACHE_DIR) and loaded through ctypes; launches go to the current
stream, so CUDA graphs capture them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading

import torch
from torch import nn

from minivllm.kernels.device import cuda_index
from minivllm.quant.w4_tiles import (TILE_K, TILE_ROWS, gate_up_row_order, rope_row_order, tile_bytes, tiles_fit,
                                     to_tiles)

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")
SOURCES = ("w4_layer_tail.cu", "w4_tile.cuh")
IN_PLAIN, IN_ADD_NORM = 0, 1
OUT_STORE, OUT_SWIGLU, OUT_QKV = 0, 1, 2
MAX_STAGES = 4
MAX_K = 8 * TILE_K  # the widest stage input the kernel takes (its stage_input cases)


AUTO_MAX_MEMORY_SHARE = 0.10  # auto mode: the tiles take at most this share of the engine's GPU memory
NO_ELIGIBLE_LAYER = "no eligible layer"  # why_not_auto's reason for a model the tail never takes (not logged)


def mode() -> str:
    """MINIVLLM_W4_LAYER_TAIL: "1" on wherever eligible (a failed build is a warning), "0" off,
    anything else (the default, "auto") on where why_not_auto finds no reason against it."""
    value = os.environ.get("MINIVLLM_W4_LAYER_TAIL", "auto")
    return value if value in ("0", "1") else "auto"


def eligible_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of `model` that can take a tail (why_not_eligible), in order."""
    return [layer for layer in getattr(model, "layers", []) if why_not_eligible(layer) is None]


def planned_tile_bytes(layers: list[nn.Module]) -> int:
    """The bytes attach_layer_tails would add for these (eligible) layers: each one's o, gate_up
    and down tiles and its qkv tiles where tileable (an upper bound: those only chained)."""
    total = 0
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        linears += [attn.qkv_proj] if _tileable(attn.qkv_proj) is None else []
        total += sum(tile_bytes(lin.out_features, lin.in_features) for lin in linears)
    return total


def why_not_auto(model: nn.Module, memory_share: float = 1.0) -> str | None:
    """None if the default (auto) mode attaches tails to `model`, else why not: no eligible layer,
    no nvcc to build the kernel, or tiles over AUTO_MAX_MEMORY_SHARE of the engine's memory (its
    `memory_share` of the GPU, gpu_memory_utilization). The tiles are a second copy of the
    weights: +3.7 GB for Llama-3.1-8B, -3 % KV cache on an H200."""
    layers = eligible_layers(model)
    if not layers:
        return NO_ELIGIBLE_LAYER
    if find_nvcc() is None:
        return "no nvcc to build its kernel (CUDA_HOME, /usr/local/cuda or PATH)"
    extra = planned_tile_bytes(layers)
    dev = layers[0].self_attn.o_proj.qweight.device
    total = torch.cuda.get_device_properties(dev).total_memory * memory_share
    if extra > AUTO_MAX_MEMORY_SHARE * total:
        return (f"its tiles would take {extra / 1e9:.1f} GB, over {AUTO_MAX_MEMORY_SHARE:.0%} of the engine's "
                f"{total / 1e9:.0f} GB (MINIVLLM_W4_LAYER_TAIL=1 forces it)")
    return None


def chain_enabled() -> bool:
    """Whether a tail also runs the next layer's input norm and qkv projection (its stage 3), so
    that a one-token step is one launch of attention and one of the tail a layer
    (CausalLM.forward_tails); MINIVLLM_W4_TAIL_CHAIN=0 keeps each layer's tail to its own layer
    (A/B runs)."""
    return os.environ.get("MINIVLLM_W4_TAIL_CHAIN", "1") != "0"


def coop_on() -> bool:
    """Whether the tail launches as a cooperative grid: the hardware then starts it only when every
    block can be resident. Its waits spin, so a grid half-resident beside another persistent grid
    (another engine of the process, the multi-model server) could hang. On unless
    MINIVLLM_W4_TAIL_COOP=0; it costs 0.1 % of W11-awq's token (lease 73, docs/perf.md). Read at
    each launch."""
    return os.environ.get("MINIVLLM_W4_TAIL_COOP", "1") != "0"


def pdl_on(device: torch.device) -> bool:
    """The tail launches with PDL where the engine's kernels do (kernels/pdl.py), unless
    MINIVLLM_W4_TAIL_PDL=0 (A/B runs). Read at each launch."""
    from minivllm.kernels.pdl import pdl_enabled
    return pdl_enabled(device) and os.environ.get("MINIVLLM_W4_TAIL_PDL", "1") != "0"


class _Stage(ctypes.Structure):  # FlatStage in w4_layer_tail.cu
    _fields_ = [("tiles", ctypes.c_void_p), ("in0", ctypes.c_void_p), ("in1", ctypes.c_void_p),
                ("norm_w", ctypes.c_void_p), ("res_out", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("k", ctypes.c_int), ("rowtiles", ctypes.c_int), ("kchunks", ctypes.c_int),
                ("in_kind", ctypes.c_int), ("out_kind", ctypes.c_int)]


class _Rope(ctypes.Structure):  # FlatRope in w4_layer_tail.cu
    _fields_ = [("positions", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("stride_block", ctypes.c_longlong),
                ("stride_slot", ctypes.c_longlong), ("stride_head", ctypes.c_longlong), ("cs_stride", ctypes.c_int),
                ("block_size", ctypes.c_int), ("q_heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("rotate", ctypes.c_int)]


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _cache_dir() -> str:
    return os.environ.get("MINIVLLM_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "minivllm"))


_lib_lock = threading.Lock()
_libs: dict[tuple[str, ...], ctypes.CDLL] = {}


def engine_defines() -> tuple[str, ...]:
    """MINIVLLM_W4_TAIL_DEFINES: comma-separated -D defines of the engine's build (experiments'
    A/B runs: the kernel's W4LT_* variants); none by default."""
    return tuple(d for d in os.environ.get("MINIVLLM_W4_TAIL_DEFINES", "").split(",") if d)


def load_library(defines: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """The compiled kernel (built once per source version and set of -D defines, e.g. the
    profiling build's W4LT_PROFILE; default: engine_defines(); raises RuntimeError naming what
    is missing: nvcc, or the compiler's message)."""
    defines = engine_defines() if defines is None else defines
    with _lib_lock:
        if defines in _libs:
            return _libs[defines]
        digest = hashlib.sha256(repr(defines).encode())
        for name in SOURCES:
            with open(os.path.join(SOURCE_DIR, name), "rb") as f:
                digest.update(f.read())
        path = os.path.join(_cache_dir(), f"w4_layer_tail-{digest.hexdigest()[:16]}.so")
        if not os.path.exists(path):
            _build(path, defines)
        lib = ctypes.CDLL(path)
        lib.w4lt_grid.restype = ctypes.c_int
        lib.w4lt_grid.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.w4lt_launch.restype = ctypes.c_int
        lib.w4lt_launch.argtypes = [ctypes.POINTER(_Stage), ctypes.c_int, ctypes.POINTER(_Rope), ctypes.c_void_p,
                                    ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_void_p]
        lib.w4lt_error_string.restype = ctypes.c_char_p
        lib.w4lt_error_string.argtypes = [ctypes.c_int]
        _libs[defines] = lib
        return lib


def _build(path: str, defines: tuple[str, ...] = ()) -> None:
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("MINIVLLM_W4_LAYER_TAIL=1 needs nvcc (the CUDA toolkit) to build its kernel: none found in "
                           "CUDA_HOME, /usr/local/cuda or PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a",
           *(f"-D{d}" for d in defines), "-o", tmp, os.path.join(SOURCE_DIR, "w4_layer_tail.cu")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the W4 layer tail failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    os.replace(tmp, path)  # atomic: a concurrent builder's file is as good as ours
    logger.info("built the W4 layer tail kernel: %s", path)


def stage(tiles: torch.Tensor, in0: torch.Tensor, out: torch.Tensor, k: int, rows: int, in_kind: int = IN_PLAIN,
          out_kind: int = OUT_STORE, in1: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
          res_out: torch.Tensor | None = None) -> _Stage:
    """One stage of a launch: a GEMV of `rows` outputs (tile rows: OUT_SWIGLU's pairs count 2 a
    row) over k inputs."""
    ptr = (lambda t: 0 if t is None else t.data_ptr())
    return _Stage(tiles.data_ptr(), in0.data_ptr(), ptr(in1), ptr(norm_w), ptr(res_out), out.data_ptr(), k,
                  rows // 16, k // TILE_K, in_kind, out_kind)


def launch(stages: list[_Stage], counters: torch.Tensor, eps: float, grid: int, kmax: int, device: torch.device,
           lib: ctypes.CDLL | None = None, rope: _Rope | None = None) -> None:
    """One launch of the kernel over `stages` on the current stream (raises on a launch error);
    `rope`: an OUT_QKV stage's (qkv_rope)."""
    lib = lib or load_library()
    err = lib.w4lt_launch((_Stage * len(stages))(*stages), len(stages), None if rope is None else ctypes.byref(rope),
                          counters.data_ptr(), float(eps), grid, kmax, int(pdl_on(device)), int(coop_on()),
                          torch.cuda.current_stream(device).cuda_stream)
    if err != 0:
        raise RuntimeError(f"W4 layer tail launch failed: {lib.w4lt_error_string(err).decode()}")


class RopeTarget:
    """The next layer's attention inputs that a chained tail's qkv stage fills: rotary on q and k
    with the `cos_sin` table at the token's position, and the rotated K with V stored in the
    caches at the token's slot (what Attention.attend_qkv's rotary_store_kv does)."""

    def __init__(self, positions: torch.Tensor, slot_mapping: torch.Tensor, cos_sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.positions, self.slot_mapping, self.cos_sin = positions, slot_mapping, cos_sin
        self.k_cache, self.v_cache = k_cache, v_cache


def rope_target(attention: nn.Module, positions: torch.Tensor, slot_mapping: torch.Tensor) -> RopeTarget | None:
    """A RopeTarget for this Attention's one-token step, or None where the tail's epilogue does not
    do what attend_qkv would: the CUDA rotary_store_kv path (MINIVLLM_ROTARY_STORE_KV) with float16
    caches of q's dtype, no q/k norm, no FP8 scale calibration, int64 positions and slots, a float32
    cos | sin table over the whole head dim, and MINIVLLM_W4_TAIL_ROPE not 0."""
    from minivllm.kernels.store_kv import rotary_store_enabled
    if os.environ.get("MINIVLLM_W4_TAIL_ROPE", "1") == "0" or not rotary_store_enabled():
        return None
    k_cache, v_cache = getattr(attention, "k_cache", None), getattr(attention, "v_cache", None)
    cos_sin = attention.rotary.cos_sin
    if (getattr(attention.backend, "rotary_store_kv", None) is None or attention.q_norm is not None
            or attention.calibrate_kv or k_cache is None or v_cache is None or k_cache.dim() != 4
            or k_cache.dtype != torch.float16 or v_cache.dtype != torch.float16
            or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
            or tuple(k_cache.shape[2:]) != (attention.num_kv_heads, attention.head_dim)
            or cos_sin.dtype != torch.float32 or cos_sin.shape[-1] != attention.head_dim or cos_sin.stride(-1) != 1
            or positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64
            or attention.head_dim % TILE_ROWS != 0):
        return None
    return RopeTarget(positions, slot_mapping, cos_sin, k_cache, v_cache)


def qkv_rope(target: RopeTarget | None, heads: tuple[int, int, int]) -> _Rope:
    """The kernel's Rope for an OUT_QKV stage: with a target, rotate and store; without one,
    only the rows back in their natural order (heads: q heads, kv heads, head dim)."""
    q_heads, kv_heads, head_dim = heads
    if target is None:
        return _Rope(0, 0, 0, 0, 0, 0, 0, 0, 0, 1, q_heads, kv_heads, head_dim, 0)
    kc = target.k_cache
    return _Rope(target.positions.data_ptr(), target.cos_sin.data_ptr(), target.slot_mapping.data_ptr(),
                 kc.data_ptr(), target.v_cache.data_ptr(), kc.stride(0), kc.stride(1), kc.stride(2),
                 target.cos_sin.stride(0), kc.shape[1], q_heads, kv_heads, head_dim, 1)


class W4LayerTail(nn.Module):
    """One decoder layer's o_proj .. down_proj for a single token (module docstring).

    forward(attn [1, q_size], residual [1, H]) -> (mlp_out [1, H], o_proj(attn) + residual [1, H]):
    the values of o_proj, post_attention_layernorm and the MLP run one after the other.
    forward(attn, residual, next_tail) also runs the next layer's input_layernorm and qkv_proj
    (stage 3, with next_tail's qkv tiles) -> (qkv [1, q + 2 kv] of the next layer, its residual);
    forward(attn, residual, next_tail, rope) also rotates that qkv's q and stores its rotated K and
    V in the next layer's caches (RopeTarget: the next attention then skips its rotary_store_kv).
    `heads` (q heads, kv heads, head dim) of this layer's attention: its qkv tiles are in
    rope_row_order."""

    def __init__(self, o_proj: nn.Module, gate_up: nn.Module, down: nn.Module, norm_weight: torch.Tensor,
                 eps: float, counters: torch.Tensor, grid: int, qkv_proj: nn.Module | None = None,
                 input_norm_weight: torch.Tensor | None = None, kmax: int | None = None,
                 heads: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.q_size, self.hidden = o_proj.in_features, o_proj.out_features
        self.intermediate = down.in_features
        self.register_buffer("o_tiles", to_tiles(o_proj.qweight, o_proj.scales, o_proj.zeros), persistent=False)
        order = gate_up_row_order(self.intermediate, gate_up.qweight.device)
        self.register_buffer("gu_tiles", to_tiles(gate_up.qweight, gate_up.scales, gate_up.zeros, order),
                             persistent=False)
        self.register_buffer("down_tiles", to_tiles(down.qweight, down.scales, down.zeros), persistent=False)
        self.norm_weight, self.eps = norm_weight, eps  # post_attention_layernorm's
        # this layer's qkv_proj and input_layernorm, run by the PREVIOUS layer's tail (stage 3)
        self.qkv_rows = qkv_proj.out_features if qkv_proj is not None else 0
        self.heads = heads
        if qkv_proj is not None:
            assert heads is not None and (heads[0] + 2 * heads[1]) * heads[2] == self.qkv_rows, (heads, self.qkv_rows)
            order = rope_row_order(heads[0] + 2 * heads[1], heads[2], qkv_proj.qweight.device)
        self.register_buffer("qkv_tiles", None if qkv_proj is None else
                             to_tiles(qkv_proj.qweight, qkv_proj.scales, qkv_proj.zeros, order), persistent=False)
        self.input_norm_weight = input_norm_weight
        self.counters, self.grid = counters, grid
        # the shared memory's input row: the model's widest stage input (the grid was sized with it)
        self.kmax = kmax if kmax is not None else max(self.q_size, self.hidden, self.intermediate)

    def rope_target(self, attention: nn.Module, positions: torch.Tensor,
                    slot_mapping: torch.Tensor) -> RopeTarget | None:
        """What forward's `rope` may be for the next layer's `attention` this step (module-level
        rope_target), or None."""
        return rope_target(attention, positions, slot_mapping)

    def extra_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def forward(self, attn: torch.Tensor, residual: torch.Tensor, next_tail: W4LayerTail | None = None,
                rope: RopeTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert attn.shape == (1, self.q_size) and residual.shape == (1, self.hidden), (attn.shape, residual.shape)
        attn, residual = attn.contiguous(), residual.contiguous()
        dev = attn.device
        h, i, q = self.hidden, self.intermediate, self.q_size
        o = torch.empty(h, dtype=torch.float16, device=dev)
        act = torch.empty(i, dtype=torch.float16, device=dev)
        mlp_out = torch.empty(1, h, dtype=torch.float16, device=dev)
        res1 = torch.empty(1, h, dtype=torch.float16, device=dev)
        stages = [
            stage(self.o_tiles, attn, o, q, h),
            stage(self.gu_tiles, o, act, h, 2 * i, IN_ADD_NORM, OUT_SWIGLU, residual, self.norm_weight, res1),
            stage(self.down_tiles, act, mlp_out, i, h),
        ]
        result, rope_arg = (mlp_out, res1), None
        assert rope is None or next_tail is not None
        if next_tail is not None:
            qkv = torch.empty(1, next_tail.qkv_rows, dtype=torch.float16, device=dev)
            res2 = torch.empty(1, h, dtype=torch.float16, device=dev)
            stages.append(stage(next_tail.qkv_tiles, mlp_out, qkv, h, next_tail.qkv_rows, IN_ADD_NORM, OUT_QKV,
                                res1, next_tail.input_norm_weight, res2))
            result, rope_arg = (qkv, res2), qkv_rope(rope, next_tail.heads)
        launch(stages, self.counters, self.eps, self.grid, self.kmax, dev, rope=rope_arg)
        return result


def _tileable(lin: nn.Module) -> str | None:
    """None if this linear can run in the tail, else why not."""
    from minivllm.quant.w4a16 import W4A16Method
    if not isinstance(getattr(lin, "method", None), W4A16Method) or getattr(lin, "qweight", None) is None:
        return f"{type(lin).__name__} is not a W4A16 layer on the GPU"
    if lin.perm is not None or lin.bias is not None:
        return "act-order or bias"
    if (lin.scales.dtype != torch.float16 or not tiles_fit(lin.out_features, lin.in_features, lin.group_size)
            or lin.in_features > MAX_K):
        return (f"shape {lin.out_features}x{lin.in_features}, group {lin.group_size}, {lin.scales.dtype} "
                f"(needs fp16, group 128, inputs a multiple of 2,048 up to {MAX_K})")
    return None


def _norm_fits(norm: nn.Module) -> bool:
    return not norm.fp8_out and norm.weight.dtype == torch.float16


def why_not_eligible(layer: nn.Module) -> str | None:
    """None if this DecoderLayer can take a tail, else the reason (module docstring's list)."""
    if getattr(layer, "is_moe", False):
        return "MoE layer"
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    if attn.tp is not None or mlp.tp is not None:
        return "tensor parallelism"
    if not _norm_fits(norm):
        return f"norm weight {norm.weight.dtype}"
    for lin in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        reason = _tileable(lin)
        if reason is not None:
            return reason
    dev = attn.o_proj.qweight.device
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) != (9, 0):
        return "needs a compute capability 9.0 GPU"
    return None


def _qkv_chainable(layer: nn.Module, eps: float) -> bool:
    """Whether a tail can run this layer's input norm and qkv_proj (as the previous tail's stage 3)."""
    norm = layer.input_layernorm
    attn = layer.self_attn
    return (_tileable(attn.qkv_proj) is None and _norm_fits(norm) and norm.eps == eps
            and attn.head_dim % TILE_ROWS == 0
            and attn.qkv_proj.out_features == (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim)


def attach_layer_tails(model: nn.Module) -> int:
    """Gives every eligible decoder layer of `model` a W4LayerTail (`layer.tail`); returns how
    many. With every layer eligible (and chain_enabled()), each tail also holds its layer's qkv
    tiles and the model runs one-token steps through CausalLM.forward_tails (`model.tail_chain`).
    Raises RuntimeError if the kernel cannot be built or launched on this GPU."""
    all_layers = list(getattr(model, "layers", []))
    layers = eligible_layers(model)
    if not layers:
        reasons = {why_not_eligible(layer) for layer in all_layers}
        logger.info("W4 layer tail: no eligible layer (%s)", "; ".join(sorted(r for r in reasons if r)))
        return 0
    dev = layers[0].self_attn.o_proj.qweight.device
    lib = load_library()
    # the widest stage input sizes every launch's shared memory (and the grid: blocks that fit at once)
    kmax = max(max(layer.self_attn.o_proj.in_features, layer.mlp.down_proj.in_features,
                   layer.mlp.down_proj.out_features) for layer in layers)
    with _lib_lock:  # (w4lt_grid raises a per-device limit: one caller at a time)
        grid = lib.w4lt_grid(cuda_index(dev), kmax)
    if grid <= 0:
        raise RuntimeError(f"W4 layer tail: no block of the kernel fits this GPU (kmax {kmax}, grid {grid})")
    counters = torch.zeros(MAX_STAGES + 1, dtype=torch.int32, device=dev)  # one set: launches run in stream order
    eps = layers[0].post_attention_layernorm.eps
    chain = (chain_enabled() and len(layers) == len(all_layers) and getattr(model, "norm", None) is not None
             and getattr(model, "embed_tokens", None) is not None
             and all(_qkv_chainable(layer, eps) and layer.post_attention_layernorm.eps == eps for layer in layers))
    tails = []  # built first: a failure (e.g. out of memory) leaves the model as it was
    for layer in layers:
        norm = layer.post_attention_layernorm
        attn = layer.self_attn
        tails.append(W4LayerTail(attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj, norm.weight,
                                 norm.eps, counters, grid, attn.qkv_proj if chain else None,
                                 layer.input_layernorm.weight if chain else None, kmax,
                                 (attn.num_heads, attn.num_kv_heads, attn.head_dim)))
    for layer, tail in zip(layers, tails):
        layer.tail = tail
    extra = sum(tail.extra_bytes() for tail in tails)
    model.tail_chain = chain
    logger.info("W4 layer tail on %d of %d layers (grid %d, %.2f GB of tiles%s)", len(layers), len(all_layers),
                grid, extra / 1e9, ", chained through the next layer's qkv" if chain else "")
    return len(layers)
