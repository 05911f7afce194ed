// Linear layers for a few rows, float32, on weights stored losslessly as 4-bit affine blocks:
// the same results as packed_linear bit for bit, from a third of the weight bytes.
//
// Why: at one to a few rows (single-stream decode) a linear is bound by reading its weights,
// 4 bytes each in float32. When every block of 32 weights along K is exactly d * q + m in float32
// (q an integer in [0, 15], d and m per block) the weight needs 1 byte (q) plus 8 bytes per
// block. Weights dequantized from a 4-bit GGUF (Q4_1, the bundled SmolLM2's linears) are all of
// this form: 1.25 bytes a weight instead of 4 (models/cpu_linear.py: affine_blocks_of checks it,
// block by block, and the engine keeps the plain panels where any block is not exact).
//
// Exactness: d * q is exact in float32 (d has 11 significant bits, q 4), so fma(d, q, m) rounds
// once, as the dequantization did: the rebuilt weight is the float32 weight (the check compares
// with ==, so a -0 may come back as +0, which no product or sum below can tell apart). Each
// output column is then the panel kernel's own chain, acc = fma(x_k, w_k, acc) over k from +0,
// then + bias: the results equal packed_linear's bit for bit.
//
// Layout: panels of 16 columns. q  [ceil(N / 16), K, 16] uint8 (a row of 16 columns per k);
// d, m [ceil(N / 16), K / 32, 16] float32 (per block of 32 k and column). Columns past N: q = d =
// m = 0.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <tuple>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINIVLLM_HAVE_AFFINE 1
#endif

#include "op_library.h"

namespace {

constexpr int64_t kCols = 16;   // columns per panel: two AVX2 vectors
constexpr int64_t kBlock = 32;  // weights per (d, m) along K
constexpr int kMaxRows = 4;     // rows per pass over a panel: 2 x 4 accumulators

#ifdef MINIVLLM_HAVE_AFFINE
// 8 bytes of q -> 8 floats
inline __m256 q_to_float(const uint8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// out[r, 0 .. cols) = x[r, :] . W[col0 + c, :] (+ bias) for R rows over one panel
template <int R>
void affine_panel(const float* x, int64_t ldx, const uint8_t* q, const float* d, const float* m, int64_t K,
                  float* out, int64_t ldo, int64_t cols, const float* bias) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m256 d0 = _mm256_loadu_ps(d + b * kCols), d1 = _mm256_loadu_ps(d + b * kCols + 8);
    const __m256 m0 = _mm256_loadu_ps(m + b * kCols), m1 = _mm256_loadu_ps(m + b * kCols + 8);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      const __m256 w0 = _mm256_fmadd_ps(d0, q_to_float(q + k * kCols), m0);  // the float32 weights
      const __m256 w1 = _mm256_fmadd_ps(d1, q_to_float(q + k * kCols + 8), m1);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_set1_ps(x[r * ldx + k]);
        acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
      }
    }
  }
  alignas(32) float tile[kCols];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(tile, acc[r][0]);
    _mm256_store_ps(tile + 8, acc[r][1]);
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = bias != nullptr ? tile[c] + bias[c] : tile[c] + 0.f;
  }
}

using PanelFn = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t, float*, int64_t,
                         int64_t, const float*);
constexpr PanelFn kPanelFn[kMaxRows + 1] = {nullptr, affine_panel<1>, affine_panel<2>, affine_panel<3>,
                                            affine_panel<4>};
#endif

// float16 rounding of a float (to nearest even), and its neighbours, as floats: d candidates.
inline float to_half(float v) { return c10::Half(v); }
inline float half_step(float h, int dir) {
  c10::Half x(h);
  uint16_t bits = x.x;
  if (h == 0.f) return dir > 0 ? static_cast<float>(c10::Half(0x0001, c10::Half::from_bits())) : 0.f;
  bits = static_cast<uint16_t>(bits + ((h > 0) == (dir > 0) ? 1 : -1));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Fits one block w[0 .. 32): m = min, d one of float16((max - min) / 15) and its two float16
// neighbours; true (with d, q) when d * q + m rebuilds every weight exactly in float32.
bool fit_block(const float* w, float& d_out, float& m_out, uint8_t* q_out) {
  float lo = w[0], hi = w[0];
  for (int i = 1; i < kBlock; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
  }
  const float base = to_half((hi - lo) / 15.f);
  for (const float d : {base, half_step(base, 1), half_step(base, -1)}) {
    if (!std::isfinite(d) || d < 0.f) continue;
    bool ok = true;
    for (int i = 0; i < kBlock && ok; ++i) {
      const float qf = d > 0.f ? std::min(15.f, std::max(0.f, std::nearbyint((w[i] - lo) / d))) : 0.f;
      ok = std::fma(d, qf, lo) == w[i];
      q_out[i] = static_cast<uint8_t>(qf);
    }
    if (ok) {
      d_out = d;
      m_out = lo;
      return true;
    }
  }
  return false;
}

}  // namespace

// W [N, K] float32 -> (q, d, m) in the layout above when every block of 32 along K is exactly
// d * q + m (see the top), else three empty tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> affine_blocks_of(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
              weight.is_contiguous(), "affine_blocks_of: weight must be a contiguous float32 CPU [N, K]");
  const auto none = [&] {  // not affine blocks: three empty tensors
    return std::make_tuple(at::empty({0}, weight.options().dtype(at::kByte)), at::empty({0}, weight.options()),
                           at::empty({0}, weight.options()));
  };
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kCols - 1) / kCols, B = K / kBlock;
  if (K % kBlock != 0) return none();
  at::Tensor q = at::zeros({panels, K, kCols}, weight.options().dtype(at::kByte));
  at::Tensor d = at::zeros({panels, B, kCols}, weight.options());
  at::Tensor m = at::zeros({panels, B, kCols}, weight.options());
  const float* wp = weight.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    uint8_t block_q[kBlock];
    for (int64_t n = begin; n < end && exact; ++n) {
      const int64_t p = n / kCols, c = n % kCols;
      for (int64_t b = 0; b < B; ++b) {
        float dv, mv;
        if (!fit_block(wp + n * K + b * kBlock, dv, mv, block_q)) {
          exact = false;
          break;
        }
        dp[(p * B + b) * kCols + c] = dv;
        mp[(p * B + b) * kCols + c] = mv;
        for (int i = 0; i < kBlock; ++i) qp[(p * K + b * kBlock + i) * kCols + c] = block_q[i];
      }
    }
  });
  if (!exact) return none();
  return {q, d, m};
}

// Whether this build has the kernel (AVX2); the engine keeps the plain panels without it.
bool affine_block_linear_available() {
#ifdef MINIVLLM_HAVE_AFFINE
  return true;
#else
  return false;
#endif
}

// y = x W^T + b for x [M, K] (rows contiguous), W given as its affine blocks (see the top).
at::Tensor affine_block_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                               int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "affine_block_linear: x must be a float32 CPU [M, K] tensor with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + kCols - 1) / kCols;
  TORCH_CHECK(K % kBlock == 0, "affine_block_linear: K must be a multiple of ", kBlock, ", got ", K);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 3 && q.size(0) == panels &&
              q.size(1) == K && q.size(2) == kCols, "affine_block_linear: q must be uint8 [ceil(N/16), K, 16]");
  for (const at::Tensor* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == panels &&
                t->size(1) == K / kBlock && t->size(2) == kCols, "affine_block_linear: d and m must be float32 [ceil(N/16), K/32, 16]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "affine_block_linear: bias must be a contiguous float32 [N]");
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef MINIVLLM_HAVE_AFFINE
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * kCols, cols = std::min(kCols, N - col);
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {  // each pass re-reads the panel from L1/L2
        const int64_t R = std::min<int64_t>(kMaxRows, M - r0);
        kPanelFn[R](xp + r0 * ldx, ldx, qp + p * K * kCols, dp + p * (K / kBlock) * kCols, mp + p * (K / kBlock) * kCols,
                    K, op + r0 * N + col, N, cols, bp != nullptr ? bp + col : nullptr);
      }
    }
  });
#else
  TORCH_CHECK(false, "affine_block_linear: this build has no AVX2 path");
#endif
  return out;
}

MINIVLLM_FRAGMENT(MINIVLLM_OPS_NAMESPACE, m) {
  m.def("affine_block_linear_available() -> bool", &affine_block_linear_available);
  m.def("affine_block_linear(Tensor x, Tensor q, Tensor d, Tensor m, int N, Tensor? bias) -> Tensor");
  m.def("affine_blocks_of(Tensor weight) -> (Tensor, Tensor, Tensor)");
}

MINIVLLM_LIBRARY_IMPL(MINIVLLM_OPS_NAMESPACE, CPU, m) {
  m.impl("affine_block_linear", &affine_block_linear);
  m.impl("affine_blocks_of", &affine_blocks_of);
}
