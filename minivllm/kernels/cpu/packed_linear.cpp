// Linear layers for the CPU, float32, on weights packed once into column panels: y = x W^T + b.
//
// Why: at the row counts of decode (1 row a running sequence) the GEMM libraries fall short on
// some CPUs. On a 2-core AMD EPYC (AVX2) MKL's matrix-vector product read the weights at 12-20
// GB/s of the ~31 the memory gives, and oneDNN reached 112-148 GFLOP/s at 32 rows against
// ~170 for a large GEMM (docs/perf.md, session 7). Here every weight byte is read once per call,
// in order, and the row loop runs while a panel is in L2.
//
// Layout: pack_linear_weight(W [N, K]) -> panels [ceil(N / P), K, P], P = 2 vectors of floats
// (16 with AVX2, 32 with AVX-512); panel p holds output columns p*P .. p*P + P - 1 (zero past N),
// and k-major inside, so the kernel streams it front to back.
//
// packed_linear(x [M, K] rows contiguous, panels, N, bias [N]?) -> [M, N]
//   Work split: panels over torch's threads (at::parallel_for; each thread streams its own
//   contiguous share of the weights). Inside a thread: rows in chunks of kChunkRows (the chunk of
//   x stays in L2), then its panels, then row blocks of up to kBlockRows rows (shared evenly): the micro-kernel
//   holds a block's R x 2 accumulators in registers over the whole K and broadcasts one x value
//   per row and k (the register-blocked GEMM of BLIS and of most CPU BLAS libraries).
//
// Builds without AVX2 or AVX-512 have no packed path (packed_panel_width() returns 0) and the
// engine keeps the libraries' linears.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "op_library.h"
#include "vec_math.h"

namespace {

constexpr int kBlockRows = 6;     // 6 x 2 accumulators + 2 panel vectors + 1 broadcast <= 16 registers
constexpr int64_t kChunkRows = 48;

#ifdef MINIVLLM_HAVE_VEC
using V = minivllm_vec::VecBest;
constexpr int64_t kPanel = 2 * V::kWidth;

// out[r, 0 .. cols) = x[r, :] . panel[:, c] (+ bias) for R rows; cols <= kPanel (the last panel).
// Also fetches row k of the panel `pf` (nullptr: none) into L2 for every k with k % pf_every ==
// pf_phase (see packed_linear).
template <int R>
void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
                  int64_t cols, const float* bias, const float* pf, int64_t pf_every, int64_t pf_phase) {
  using T = V::T;
  T acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V::zero();
  for (int64_t k = 0, phase = pf_phase; k < K; ++k) {
    if (pf != nullptr && phase-- == 0) {
      phase = pf_every - 1;
      for (int line = 0; line < kPanel; line += 16)
        _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel + line), _MM_HINT_T1);
    }
    const T b0 = V::load(panel + k * kPanel), b1 = V::load(panel + k * kPanel + V::kWidth);
    for (int r = 0; r < R; ++r) {
      const T a = V::set1(x[r * ldx + k]);
      acc[r][0] = V::fmadd(a, b0, acc[r][0]);
      acc[r][1] = V::fmadd(a, b1, acc[r][1]);
    }
  }
  T bias0 = V::zero(), bias1 = V::zero();
  alignas(64) float tail[kPanel];
  if (bias != nullptr) {
    std::fill(tail, tail + kPanel, 0.f);
    std::copy(bias, bias + cols, tail);
    bias0 = V::load(tail);
    bias1 = V::load(tail + V::kWidth);
  }
  for (int r = 0; r < R; ++r) {
    const T y0 = V::add(acc[r][0], bias0), y1 = V::add(acc[r][1], bias1);
    if (cols == kPanel) {
      V::store(out + r * ldo, y0);
      V::store(out + r * ldo + V::kWidth, y1);
    } else {
      V::store(tail, y0);
      V::store(tail + V::kWidth, y1);
      std::copy(tail, tail + cols, out + r * ldo);
    }
  }
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                        const float*, int64_t, int64_t);
constexpr MicroFn kMicro[kBlockRows + 1] = {nullptr,         micro_kernel<1>, micro_kernel<2>, micro_kernel<3>,
                                            micro_kernel<4>, micro_kernel<5>, micro_kernel<6>};
#else
constexpr int64_t kPanel = 0;
#endif

}  // namespace

int64_t packed_panel_width() { return kPanel; }

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(kPanel > 0, "pack_linear_weight: this build has no vector path");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_linear_weight: weight must be a float32 CPU [N, K] tensor");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  // [N_pad, K] -> [panels, P, K] -> [panels, K, P]
  at::Tensor padded = at::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

namespace {

// A packed op's inputs as raw pointers and sizes: x [M, K] (row stride ldx), the panels of a
// weight with N output columns, the bias (nullptr: none).
struct Operands {
  const float* x;
  int64_t ldx, M, K, N;
  const float* panels;
  const float* bias;
};

// Checks a packed op's inputs (op names the op in the error) and returns them as Operands.
Operands packed_operands(const char* op, const at::Tensor& x, const at::Tensor& panels, int64_t N,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kPanel > 0, op, ": this build has no vector path");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be a float32 CPU [M, K] tensor with contiguous rows");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
              panels.size(1) == x.size(1) && panels.size(2) == kPanel && N > (panels.size(0) - 1) * kPanel &&
              N <= panels.size(0) * kPanel, op, ": panels must be pack_linear_weight's [ceil(N/P), K, P]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, op,
                ": bias must be a contiguous float32 [N]");
  return {x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), N, panels.data_ptr<float>(),
          bias.has_value() ? bias->data_ptr<float>() : nullptr};
}

#ifdef MINIVLLM_HAVE_VEC
// fn(r, rows, j, blocks) for the row blocks j = 0 .. blocks - 1 of rows [m0, m1), block j
// starting at row r. The rows are shared evenly (32 rows: 6, 6, 5, 5, 5, 5): a last block of one
// or two rows has too few accumulators to hide the FMA latency (measured: 32 rows over the
// model's cold weights 54.0 -> 52.8 ms against blocks of 6, 6, 6, 6, 6, 2).
//
// The callers' prefetch: the row blocks of a panel share out the fetching of the thread's next
// panel, so it streams in from memory while this one is computed. Without it the first row
// block of every panel waited on memory (it wants ~32 GB/s a core) and the others ran from L2:
// 32 decode rows took 66 ms over the model's cold weights against 54 warm. A single row block is
// bound by the memory anyway and leaves it to the hardware. Block j fetches the rows k = j,
// j + blocks, ... of the next panel: an even pace.
template <class Fn>
inline void for_each_row_block(int64_t m0, int64_t m1, Fn&& fn) {
  const int64_t blocks = (m1 - m0 + kBlockRows - 1) / kBlockRows;
  const int64_t base_rows = (m1 - m0) / blocks, extra = (m1 - m0) % blocks;
  for (int64_t r = m0, j = 0, rows = 0; r < m1; r += rows, ++j) {
    rows = base_rows + (j < extra ? 1 : 0);
    fn(r, rows, j, blocks);
  }
}

// One thread's share of y = x W^T + b: panels [begin, end) for all M rows. Where a row block's
// results go is up to `sink`: sink.tile(r, col) gives the destination (pointer, row stride) of
// the block starting at row r, column col; sink.done(r, rows, col, cols) runs after the block.
template <class Sink>
void run_panels(const Operands& a, int64_t begin, int64_t end, Sink& sink) {
  const float *xp = a.x, *wp = a.panels, *bp = a.bias;
  const int64_t ldx = a.ldx, M = a.M, K = a.K, N = a.N;
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t m1 = std::min(M, m0 + kChunkRows);
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * kPanel;
      const int64_t col = p * kPanel, cols = std::min(kPanel, N - col);
      const float* pb = bp != nullptr ? bp + col : nullptr;
      for_each_row_block(m0, m1, [&](int64_t r, int64_t rows, int64_t j, int64_t blocks) {
        const float* next = blocks > 1 && p + 1 < end ? panel + K * kPanel : nullptr;
        const auto [dst, ldo] = sink.tile(r, col);
        kMicro[rows](xp + r * ldx, ldx, panel, K, dst, ldo, cols, pb, next, blocks, j);
        sink.done(r, rows, col, cols);
      });
    }
  }
}

// One thread's share of silu(x Wg^T + bg) * (x Wu^T + bu), the MLP's gate-up product and its
// activation in one pass, for a gate_up weight [Wg; Wu] (N = 2 I columns, I a multiple of kPanel)
// packed whole: gate panels [begin, end) of the I / kPanel, each with its up panel I / kPanel
// panels on. A row block goes into two small tiles, then silu_mul_row writes its I columns: the
// [M, 2 I] product is never written out and read back.
void run_gate_up_panels(const Operands& a, int64_t begin, int64_t end, float* out) {
  const float *xp = a.x, *wp = a.panels, *bp = a.bias;
  const int64_t ldx = a.ldx, M = a.M, K = a.K, I = a.N / 2;
  const int64_t up_offset = I / kPanel * K * kPanel;  // floats from a gate panel to its up panel
  alignas(64) float gate_tile[kBlockRows * kPanel];
  alignas(64) float up_tile[kBlockRows * kPanel];
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t m1 = std::min(M, m0 + kChunkRows);
    for (int64_t p = begin; p < end; ++p) {
      const float* gate = wp + p * K * kPanel;
      const float* up = gate + up_offset;
      const int64_t col = p * kPanel;
      const float* gate_bias = bp != nullptr ? bp + col : nullptr;
      const float* up_bias = bp != nullptr ? bp + I + col : nullptr;
      for_each_row_block(m0, m1, [&](int64_t r, int64_t rows, int64_t j, int64_t blocks) {
        const bool fetch = blocks > 1 && p + 1 < end;  // both next panels, as in run_panels
        kMicro[rows](xp + r * ldx, ldx, gate, K, gate_tile, kPanel, kPanel, gate_bias,
                     fetch ? gate + K * kPanel : nullptr, blocks, j);
        kMicro[rows](xp + r * ldx, ldx, up, K, up_tile, kPanel, kPanel, up_bias, fetch ? up + K * kPanel : nullptr,
                     blocks, j);
        for (int64_t i = 0; i < rows; ++i)
          minivllm_vec::silu_mul_row(gate_tile + i * kPanel, up_tile + i * kPanel, out + (r + i) * I + col, kPanel);
      });
    }
  }
}

struct MatrixSink {  // results straight into out [M, N]
  float* out;
  int64_t N;
  std::pair<float*, int64_t> tile(int64_t r, int64_t col) const { return {out + r * N + col, N}; }
  void done(int64_t, int64_t, int64_t, int64_t) const {}
};

// torch.argmax's order: a NaN beats every number (the first NaN wins), and among equal values
// the lowest column wins (columns arrive in increasing order, so only a strict win replaces)
inline bool beats(float v, float best, int64_t best_col) {
  return best_col < 0 || v > best || (std::isnan(v) && !std::isnan(best));
}

struct ArgmaxSink {  // a block's results into a small tile, folded into each row's running argmax
  alignas(64) float tile_buf[kBlockRows * kPanel];
  std::vector<float> best;     // [M]
  std::vector<int64_t> where;  // [M], -1 before the thread's first column
  explicit ArgmaxSink(int64_t M) : best(M, 0.f), where(M, -1) {}
  std::pair<float*, int64_t> tile(int64_t, int64_t) { return {tile_buf, kPanel}; }
  void done(int64_t r, int64_t rows, int64_t col, int64_t cols) {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = tile_buf[i * kPanel + c];
        if (beats(v, best[r + i], where[r + i])) {
          best[r + i] = v;
          where[r + i] = col + c;
        }
      }
  }
};
#endif

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const std::optional<at::Tensor>& bias) {
  const Operands a = packed_operands("packed_linear", x, panels, N, bias);
  at::Tensor out = at::empty({a.M, N}, x.options());
#ifdef MINIVLLM_HAVE_VEC
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    MatrixSink sink{op, N};
    run_panels(a, begin, end, sink);
  });
#endif
  return out;
}

// silu(gate) * up of the MLP in one pass: x [M, K] and gate_up's panels (N = 2 I columns, gate
// then up, I a multiple of packed_panel_width()) -> [M, I]. Equal to silu_mul(packed_linear(...)):
// the same products and the same activation code.
at::Tensor packed_linear_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                                  const std::optional<at::Tensor>& bias) {
  const Operands a = packed_operands("packed_linear_silu_mul", x, panels, N, bias);
  TORCH_CHECK(N % (2 * std::max<int64_t>(kPanel, 1)) == 0, "packed_linear_silu_mul: N must be a multiple of 2 * ",
              kPanel, ", got ", N);
  at::Tensor out = at::empty({a.M, N / 2}, x.options());
#ifdef MINIVLLM_HAVE_VEC
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N / 2 / kPanel, 1, [&](int64_t begin, int64_t end) { run_gate_up_panels(a, begin, end, op); });
#endif
  return out;
}

// argmax over the columns of x W^T + b, per row, without the [M, N] result: the greedy token of
// each row from the LM head (SmolLM2: 49,152 columns, 6 MB of logits at 32 rows not written and
// not read back). Equal to packed_linear(...).argmax(-1): the same arithmetic, torch's tie order.
at::Tensor packed_linear_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                                const std::optional<at::Tensor>& bias) {
  const Operands a = packed_operands("packed_linear_argmax", x, panels, N, bias);
  const int64_t M = a.M;
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
#ifdef MINIVLLM_HAVE_VEC
  // each thread's running argmax over its panels, merged in panel order below
  std::vector<std::pair<int64_t, std::unique_ptr<ArgmaxSink>>> parts(at::get_num_threads());
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    auto sink = std::make_unique<ArgmaxSink>(M);
    run_panels(a, begin, end, *sink);
    parts[at::get_thread_num()] = {begin, std::move(sink)};
  });
  std::sort(parts.begin(), parts.end(), [](const auto& lo, const auto& hi) { return lo.first < hi.first; });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    float best = 0.f;
    int64_t where = -1;
    for (const auto& part : parts)
      if (part.second != nullptr && part.second->where[r] >= 0 && beats(part.second->best[r], best, where)) {
        best = part.second->best[r];
        where = part.second->where[r];
      }
    op[r] = where;
  }
#endif
  return out;
}

MINIVLLM_FRAGMENT(MINIVLLM_OPS_NAMESPACE, m) {
  m.def("packed_panel_width() -> int", &packed_panel_width);
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor panels, int N, Tensor? bias) -> Tensor");
  m.def("packed_linear_argmax(Tensor x, Tensor panels, int N, Tensor? bias) -> Tensor");
  m.def("packed_linear_silu_mul(Tensor x, Tensor panels, int N, Tensor? bias) -> Tensor");
}

MINIVLLM_LIBRARY_IMPL(MINIVLLM_OPS_NAMESPACE, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_argmax", &packed_linear_argmax);
  m.impl("packed_linear_silu_mul", &packed_linear_silu_mul);
}
