"""CPU fp32 linear layers on prepacked weights: minivllm's own panel kernel or oneDNN's.

Two packings, one per layer:
- minivllm's (`kernels/cpu/packed_linear.cpp`): column panels streamed once per call by a
  register-blocked micro-kernel, at every row count. On a 2-core AMD EPYC (Zen 3, AVX2) it beat
  oneDNN at every row count from 1 to 2,048 (the model's 32-row chain over cold weights 1.5x,
  one row 1.4x: the weights read at the memory's bandwidth). Used on AMD CPUs
  (`kernel_linear_preferred`).
- oneDNN's, described below, everywhere else: on an Intel Xeon (Sapphire Rapids) oneDNN was
  1.6x faster at 32 rows (both kernel builds, AVX-512 and AVX2; ours was 1.1-1.9x faster at one
  row only). The measurements are in docs/perf.md, session 7 (the probe that took them, scripts/probe_cpu_linear.py, is in git history).

On the CPU, oneDNN with a weight reordered once into its blocked layout runs the linear shapes
of a batch 1.5-2x faster than `F.linear` (MKL on a plain row-major weight) from a few tokens up,
whatever the token count; for one or two tokens (single-stream decode, a matrix-vector product
bound by weight reads) `F.linear` is as fast or faster. `PackedLinear` keeps both: the original
weight (shared, e.g. with tied embeddings) and a packed copy, and picks by the number of rows.

Results differ from `F.linear` by fp32 summation order only (~1e-6 relative).

`pack_linears(model, ops)` is called by the runner after loading when the model runs on the CPU
in float32; MINIVLLM_CPU_PACKED_LINEAR=0 turns both packings off, MINIVLLM_CPU_LINEAR_KERNEL=0/1
forces minivllm's kernel off/on (where it is built).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Below this many rows F.linear is used (measured on a 2-core Xeon: oneDNN is slower at 1-2 rows
# and faster from 4, docs/perf.md W5).
MIN_PACKED_ROWS = 3
ENV_FLAG = "MINIVLLM_CPU_PACKED_LINEAR"
KERNEL_ENV_FLAG = "MINIVLLM_CPU_LINEAR_KERNEL"
SCREEN_ENV_FLAG = "MINIVLLM_CPU_SCREENED_ARGMAX"
SCREEN_GROUP = 32  # features per activation scale in kernels/cpu/screened_argmax.cpp
# argmax_rows takes the int8 screen up to this many rows: measured on a 2-core AMD EPYC (Zen 3),
# SmolLM2's LM head on W5's hidden states, screen vs fp32 kernel: 1 row 1.2 vs 4.5 ms, 8 rows 2.6 vs
# 5.9, 32 rows 8.6 vs 11.4, 64 rows 16.9 vs 24.3, 256 rows 69 vs 86 (docs/perf.md, session 10);
# not measured beyond
SCREEN_MAX_ROWS = 256
# a row whose screen leaves more candidates than out_features / SCREEN_MAX_CANDIDATES_DIV (at
# least 64) takes the exact kernel: their fp32 products would cost more than the screen saves
SCREEN_MAX_CANDIDATES_DIV = 16
AFFINE_ENV_FLAG = "MINIVLLM_CPU_AFFINE_BLOCKS"
AFFINE_BLOCK = 32  # weights per (d, m) along K in kernels/cpu/affine_block_linear.cpp
# forward takes the affine blocks up to this many rows: measured on a 2-core AMD EPYC (Zen 3),
# SmolLM2's 120 decoder linears, 1 row 16.1 -> 6.8 ms, 4 rows 17.3 -> 8.0, 8 rows 20.7 -> 13.9,
# 12 rows 25.3 -> 20.2, 16 rows even, 32 rows 49.5 -> 58.5 (docs/perf.md, session 9)
AFFINE_MAX_ROWS = 12
# CPU vendors where the panel kernel was measured faster than oneDNN (docs/perf.md, session 7)
KERNEL_PREFERRED_VENDORS = ("AuthenticAMD",)


def packed_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and os.environ.get(ENV_FLAG, "1") != "0"


def kernel_linear_preferred(ops) -> bool:
    """Whether to run the linears on minivllm's panel kernel from `ops` (kernels/cpu_kernels.py)."""
    if ops is None or ops.packed_panel_width() == 0 or os.environ.get(ENV_FLAG, "1") == "0":
        return False
    forced = os.environ.get(KERNEL_ENV_FLAG)
    if forced is not None:
        return forced != "0"
    return _cpu_vendor() in KERNEL_PREFERRED_VENDORS


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("AuthenticAMD", "GenuineIntel"), "" where there is none."""
    from minivllm.kernels.cpu_kernels import cpuinfo_field
    return cpuinfo_field("vendor_id")


class PackedLinear(nn.Module):
    """nn.Linear on a packed copy of its weight: minivllm's panels when `ops` is given (every row
    count), else oneDNN's (from `min_rows` rows; F.linear on the plain weight below)."""

    def __init__(self, linear: nn.Linear, min_rows: int = MIN_PACKED_ROWS, ops=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: tied weights stay tied
        self.bias = linear.bias
        self.min_rows = min_rows
        self.ops = ops
        # packed copies are plain attributes, not parameters or buffers: derived data, rebuilt by
        # packing again. panels: [ceil(N / P), K, P] float32; packed: an opaque oneDNN tensor
        self.panels = self.packed = None
        self.screen = None  # prepare_screened_argmax's tensors
        self.affine = None  # prepare_affine_blocks' (q, d, m)
        if ops is not None:
            self.panels = ops.pack_linear_weight(linear.weight.detach())
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        # silu_mul_rows can run: the panel kernel, and half the columns a whole number of panels
        # (gate and up then start on panel boundaries). Fixed by the packing: decided once here.
        width = ops.packed_panel_width() if ops is not None else 0
        self.fuses_silu_mul = width > 0 and self.out_features % (2 * width) == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            if x.shape[-1] != self.in_features:  # checked here: the kernel's own check is a last line
                raise ValueError(f"linear input has {x.shape[-1]} features, expected {self.in_features}")
            lead = x.shape[:-1]
            rows = x.reshape(-1, self.in_features)
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            return self._panel_product(rows).view(*lead, self.out_features)
        if x.numel() < self.min_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _from_affine_blocks(self, rows: torch.Tensor) -> bool:
        """Whether a product of these rows reads the affine blocks: prepared, up to AFFINE_MAX_ROWS rows."""
        return self.affine is not None and rows.shape[0] <= AFFINE_MAX_ROWS

    def _panel_product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, in] (contiguous rows) -> [T, out] on the panel kernel, from the affine blocks
        where _from_affine_blocks (the same bits), else from the panels."""
        if self._from_affine_blocks(rows):
            return self.ops.affine_block_linear(rows, *self.affine, self.out_features, self.bias)
        return self.ops.packed_linear(rows, self.panels, self.out_features, self.bias)

    def _rows(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """x [T, in] with contiguous rows for the fused ops (`op` names the caller in the error)."""
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"{op} takes [T, {self.in_features}] rows, got {tuple(x.shape)}")
        return x if x.stride(-1) == 1 else x.contiguous()

    def silu_mul_rows(self, x: torch.Tensor) -> torch.Tensor:
        """For an MLP's gate_up layer (gate columns, then up): x [T, in] -> silu(gate) * up
        [T, out / 2] in one pass of the panel kernel, the [T, out] product never written out.
        Equals ops.silu_mul(forward(x)) bit for bit. Needs fuses_silu_mul."""
        if not self.fuses_silu_mul:
            raise ValueError("silu_mul_rows needs the panel kernel and out_features a multiple of 2 panels")
        rows = self._rows(x, "silu_mul_rows")
        if self._from_affine_blocks(rows):
            return self.ops.silu_mul(self._panel_product(rows))
        return self.ops.packed_linear_silu_mul(rows, self.panels, self.out_features, self.bias)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T] int64, forward(x).argmax(-1); on the panels without writing the [T, out]
        result (the kernel keeps each row's best column as it goes, with torch's tie order), or for
        up to SCREEN_MAX_ROWS rows through the int8 screen when prepared (the same answer)."""
        if self.panels is None:
            return self.forward(x).argmax(-1)
        rows = self._rows(x, "argmax_rows")
        if self.screen is not None and rows.shape[0] <= SCREEN_MAX_ROWS:
            max_candidates = max(64, self.out_features // SCREEN_MAX_CANDIDATES_DIV)
            return self.ops.screened_argmax(rows, *self.screen, self.weight.detach(), self.panels, self.out_features,
                                            self.bias, max_candidates)
        return self.ops.packed_linear_argmax(rows, self.panels, self.out_features, self.bias)

    def prepare_affine_blocks(self) -> bool:
        """Give forward (up to AFFINE_MAX_ROWS rows) the weight as 4-bit affine blocks when every
        block of 32 weights along K is exactly d * q + m in float32 (q in [0, 15], d a float16
        value, m the block's minimum: weights dequantized from 4-bit GGUF blocks, the bundled
        model's linears). The kernel (kernels/cpu/affine_block_linear.cpp) gives the same results
        bit for bit from 1.25 bytes a weight. False where the weight is not of that form (checked
        block by block), or there is no panel kernel or no AVX2, or MINIVLLM_CPU_AFFINE_BLOCKS=0."""
        if (self.panels is None or os.environ.get(AFFINE_ENV_FLAG, "1") == "0"
                or not self.ops.affine_block_linear_available() or self.in_features % AFFINE_BLOCK != 0):
            return False
        q, d, m = self.ops.affine_blocks_of(self.weight.detach().contiguous())
        self.affine = (q, d, m) if q.numel() > 0 else None
        return self.affine is not None

    def prepare_screened_argmax(self) -> bool:
        """Give argmax_rows the int8 screen (kernels/cpu/screened_argmax.cpp: the same answer at a
        quarter of the weight bytes). For an LM head; False where it cannot run (no panel kernel or
        no AVX2, in_features not a multiple of 32, non-finite weights, MINIVLLM_CPU_SCREENED_ARGMAX=0)."""
        if (self.panels is None or os.environ.get(SCREEN_ENV_FLAG, "1") == "0"
                or not self.ops.screened_argmax_available() or self.in_features % SCREEN_GROUP != 0):
            return False
        self.screen = screen_weight_stats(self.weight.detach(), self.bias)
        return self.screen is not None


def screen_weight_stats(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple | None:
    """The int8 screen of a weight [N, K] for screened_argmax: (screen panels [ceil(N/16), K/4, 64]
    uint8, scales s [N], bound terms e' [N], f' [N], c [N]), None if the weight is not finite.

    Column i: w_i ~ s_i q_i, q_i int8 in [-127, 127], stored offset as q_i + 128 (the kernel's
    vpmaddubsw wants unsigned bytes). The kernel bounds |logit_i - screen logit_i| by
    e'_i ||x|| + f'_i ||x - x_quantized|| + c_i, with e' >= ||w_i - s_i q_i|| and f' >= ||s_i q_i||.
    Each carries a slack for float rounding, 4x the classic n u bounds (u = 2^-24, n the length
    of the sums): of these norms (computed in float32), of the screen's sums and of the fp32
    product the screen stands in for; c_i covers the rounding where the bias is added."""
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()) or (bias is not None and not bool(torch.isfinite(bias).all())):
        return None
    n, k = w.shape
    s = w.abs().amax(1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s[:, None]).clamp_(-127, 127)
    u = 2.0 ** -24
    slack = 4 * (k + k // SCREEN_GROUP + 8) * u
    norm_w, norm_q = w.norm(dim=1), (s[:, None] * q).norm(dim=1)
    up = 1 + 4 * k * u  # a float32 norm of k terms is within ~k u of the exact one
    err = ((w - s[:, None] * q).norm(dim=1) + slack * (norm_w + norm_q)) * up
    norm_q = norm_q * up * (1 + slack)
    const = 4 * u * (bias.detach().float().abs() if bias is not None else torch.zeros(n)) + 1e-30
    n_pad = -(-n // 16) * 16
    offset = torch.full((n_pad, k), 128, dtype=torch.uint8)
    offset[:n] = (q + 128).to(torch.uint8)
    # [N_pad, K] -> [panels, 16 columns, K/4 quads, 4] -> [panels, quads, 16 columns x 4 bytes]
    screen = offset.view(n_pad // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(n_pad // 16, k // 4, 64)
    return screen, s.contiguous(), err.contiguous(), norm_q.contiguous(), const.float().contiguous()


def pack_linears(model: nn.Module, min_rows: int = MIN_PACKED_ROWS, ops=None) -> int:
    """Replace every CPU float32 nn.Linear of `model` by a PackedLinear (on minivllm's panel
    kernel from `ops` when given, else oneDNN); returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype == torch.float32]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, min_rows, ops))
    return len(targets)
