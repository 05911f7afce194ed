// The greedy token of each row, exactly packed_linear_argmax's answer, from a quarter of the
// weight bytes: an int8 screen of every column, then the fp32 product only for the columns the
// screen cannot rule out.
//
// Why: the LM head is the largest linear (SmolLM2: 49,152 x 576, 113 MB of fp32 weights). At a
// few rows it is bound by reading them (single-stream decode: ~5 of ~25 ms a token), and greedy
// decoding needs only each row's best column, almost every column being far below it. On a
// 2-core AMD EPYC (Zen 3) one row takes 1.2 ms instead of 4.5, eight rows 2.6 instead of 5.9.
// With many rows the screen is bound by its int8 arithmetic (vpmaddubsw + vpmaddwd, ~65 GMAC/s a
// core there, against ~50 for the fp32 kernel's FMAs): 32 rows 8.6 ms instead of 11.4, 256 rows
// 69 instead of 86. models/cpu_linear.py uses it up to SCREEN_MAX_ROWS.
//
// How, for a row x and a column w_i (exact arithmetic in the bounds):
//   - offline (screen_weight_stats in models/cpu_linear.py): w_i ~ s_i q_i with q_i int8 in
//     [-127, 127] (s_i = max|w_i| / 127); e_i >= ||w_i - s_i q_i||, f_i >= ||s_i q_i||.
//   - per call: x ~ t (.) p with p int8 in [-63, 63] and one scale t_g per group of 32 features
//     (a group with one large feature then coarsens only its own 32); rn = ||x - t (.) p||.
//   - the screen's logit a_i = s_i sum_g t_g (q_i . p)_g + b_i is exact integer arithmetic per
//     group, then float; |w_i . x + b_i - a_i| <= e_i ||x|| + f_i rn, plus a slack for the
//     rounding of this sum and of the fp32 product (Cauchy-Schwarz on each error term).
//   - so with B_i that bound, the column the fp32 product ranks first has a_i + B_i >= m, where
//     m = max_j (a_j - B_j). Those columns (the candidates: a few to a few hundred of 49,152 on
//     SmolLM2's W5 decode rows) get the fp32 product, computed exactly as the panel kernel does
//     (one fma chain over k from +0, then + b), so the result equals packed_linear_argmax bit for
//     bit, ties (lowest column) included. Rows with non-finite x, or too many candidates, take
//     packed_linear_argmax itself.
//
// The int8 product: vpmaddubsw multiplies unsigned by signed bytes, so the weights are stored
// offset, u = q + 128 in [1, 255]: sum u p = sum q p + 128 sum p, and each group's accumulator
// starts at -128 sum_g p. |u p + u' p'| <= 2 * 255 * 63 < 32,767: the 16-bit pair sums never
// saturate (that is why p has 7 bits, and why outliers are handled by the group scales).
//
// Layout: screen panels [ceil(N / 16), K / 4, 64] uint8: panel c holds columns 16c .. 16c + 15,
// and for each quad of features k = 4j .. 4j + 3 the 16 columns' 4 bytes in column order (the 8
// int32 lanes of two AVX2 vectors). K must be a multiple of 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINIVLLM_HAVE_SCREEN 1
#endif

#include "op_library.h"

// packed_linear.cpp: the exact fused argmax, for the rows the screen hands back
at::Tensor packed_linear_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                                const std::optional<at::Tensor>& bias);

namespace {

constexpr int64_t kScreenCols = 16;   // columns per screen panel (two vectors of 8 int32 lanes)
constexpr int64_t kGroup = 32;        // features per activation scale
constexpr int kActMax = 63;           // |p| <= 63: see the saturation note above
constexpr int kScreenRows = 4;        // rows per block of the int8 micro-kernel (screen_block)

// x's rows quantized per group of kGroup features, and each row's norms for the bound
struct QuantRows {
  std::vector<int8_t> p;        // [M, K]
  std::vector<float> t;         // [M, G] group scales
  std::vector<int32_t> start;   // [M, G] -128 * sum of the group's p: the accumulators' start
  std::vector<float> norm;      // [M] ||x||, rounded up
  std::vector<float> resid;     // [M] ||x - t (.) p||, rounded up
  std::vector<char> finite;     // [M] every feature finite
};

QuantRows quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  QuantRows q{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<int32_t>(M * G),
              std::vector<float>(M), std::vector<float>(M), std::vector<char>(M, 1)};
  for (int64_t r = 0; r < M; ++r) {
    const float* row = x + r * ldx;
    double norm2 = 0, resid2 = 0;
    for (int64_t g = 0; g < G; ++g) {
      float amax = 0.f;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
        if (!std::isfinite(row[k])) q.finite[r] = 0;
        amax = std::max(amax, std::fabs(row[k]));
      }
      const float t = amax / kActMax;
      int32_t sum = 0;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
        const int v = t > 0.f ? static_cast<int>(std::clamp(std::nearbyint(row[k] / t), -float(kActMax), float(kActMax))) : 0;
        q.p[r * K + k] = static_cast<int8_t>(v);
        sum += v;
        const double d = static_cast<double>(row[k]) - static_cast<double>(t) * v;
        norm2 += static_cast<double>(row[k]) * row[k];
        resid2 += d * d;
      }
      q.t[r * G + g] = t;
      q.start[r * G + g] = -128 * sum;
    }
    // rounded up a little: the bound must not shrink in the conversion to float
    q.norm[r] = static_cast<float>(std::sqrt(norm2) * (1 + 1e-6));
    q.resid[r] = static_cast<float>(std::sqrt(resid2) * (1 + 1e-6));
  }
  return q;
}

#ifdef MINIVLLM_HAVE_SCREEN
// out[r][0 .. 16) = sum_g t[r, g] * (u . p)_g for R rows over one screen panel: the group sums in
// int32 (exact), each group then scaled and added in float. The 2R int32 accumulators, the two
// weight vectors, a broadcast, a product and the ones fit the 16 AVX2 registers (R = 4); the
// float sums live in out (L1) and are updated once a group. p, start, t_group: the block's first
// row in QuantRows' arrays.
template <int R>
void screen_block(const int8_t* p, const int32_t* start, const float* t_group, int64_t K, const uint8_t* panel,
                  float* out) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kScreenCols, _mm256_setzero_ps());
    _mm256_storeu_ps(out + r * kScreenCols + 8, _mm256_setzero_ps());
  }
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_set1_epi32(start[r * G + g]);
    const uint8_t* w = panel + g * (kGroup / 4) * 64;
    for (int j = 0; j < kGroup / 4; ++j) {  // the group's quads of features
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 64 + 32));
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, p + r * K + g * kGroup + 4 * j, 4);
        const __m256i a = _mm256_set1_epi32(quad);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, a), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, a), ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 t = _mm256_set1_ps(t_group[r * G + g]);
      float* o = out + r * kScreenCols;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), t, _mm256_loadu_ps(o)));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), t, _mm256_loadu_ps(o + 8)));
    }
  }
}

using BlockFn = void (*)(const int8_t*, const int32_t*, const float*, int64_t, const uint8_t*, float*);
constexpr BlockFn kBlock[kScreenRows + 1] = {nullptr, screen_block<1>, screen_block<2>, screen_block<3>,
                                             screen_block<4>};
#endif

// One row's screen state in one thread: the best lower bound so far (the bar) and the columns
// whose upper bound reached the bar when they were seen: a superset of the final candidates,
// since the bar only rises.
struct RowScreen {
  float bar = -INFINITY;
  std::vector<std::pair<int64_t, float>> cols;  // (column, upper bound)
  void add(int64_t col, float lo, float hi) {
    if (lo > bar) bar = lo;
    if (hi >= bar) {
      cols.emplace_back(col, hi);
      if (cols.size() % 256 == 0) prune();
    }
  }
  void prune() {
    cols.erase(std::remove_if(cols.begin(), cols.end(), [&](const auto& c) { return c.second < bar; }), cols.end());
  }
};

// The screen's inputs as raw pointers (bias nullptr: none).
struct Screen {
  const uint8_t* panels;
  const float *scale, *err, *norm, *bias_bound, *bias;  // the op's scales, bound_err, bound_norm, bound_bias
  int64_t N, K;
};

#ifdef MINIVLLM_HAVE_SCREEN
// Screen panels [begin, end) for all rows: a_i = s_i * (the int8 product) + b_i and its bound
// d_i = e'_i ||x|| + f'_i rn + c_i, folded into each row's RowScreen as (a - d, a + d).
void screen_panels(const Screen& sc, const QuantRows& q, int64_t M, int64_t begin, int64_t end,
                   std::vector<RowScreen>& rows) {
  const int64_t G = sc.K / kGroup, panel_bytes = sc.K / 4 * 64;
  alignas(32) float tile[kScreenRows * kScreenCols];
  alignas(32) float lo[kScreenCols], hi[kScreenCols];
  for (int64_t c = begin; c < end; ++c) {
    const int64_t col0 = c * kScreenCols, cols = std::min(kScreenCols, sc.N - col0);
    // the panel's per-column terms, padded past N so the last panel takes the same path
    alignas(32) float s[kScreenCols] = {}, e[kScreenCols] = {}, f[kScreenCols] = {}, cb[kScreenCols] = {},
                      b[kScreenCols] = {};
    std::copy(sc.scale + col0, sc.scale + col0 + cols, s);
    std::copy(sc.err + col0, sc.err + col0 + cols, e);
    std::copy(sc.norm + col0, sc.norm + col0 + cols, f);
    std::copy(sc.bias_bound + col0, sc.bias_bound + col0 + cols, cb);
    if (sc.bias != nullptr) std::copy(sc.bias + col0, sc.bias + col0 + cols, b);
    for (int64_t r0 = 0; r0 < M; r0 += kScreenRows) {
      const int64_t R = std::min<int64_t>(kScreenRows, M - r0);
      kBlock[R](q.p.data() + r0 * sc.K, q.start.data() + r0 * G, q.t.data() + r0 * G, sc.K,
                sc.panels + c * panel_bytes, tile);
      for (int64_t r = 0; r < R; ++r) {
        RowScreen& row = rows[r0 + r];
        const __m256 xn = _mm256_set1_ps(q.norm[r0 + r]), xr = _mm256_set1_ps(q.resid[r0 + r]);
        const __m256 bar = _mm256_set1_ps(row.bar);
        int reach = 0;  // bit i: column i's upper bound reaches the bar
        for (int v = 0; v < 2; ++v) {
          const __m256 a = _mm256_fmadd_ps(_mm256_load_ps(s + 8 * v), _mm256_load_ps(tile + r * kScreenCols + 8 * v),
                                           _mm256_load_ps(b + 8 * v));
          const __m256 d = _mm256_fmadd_ps(_mm256_load_ps(e + 8 * v), xn,
                                           _mm256_fmadd_ps(_mm256_load_ps(f + 8 * v), xr, _mm256_load_ps(cb + 8 * v)));
          _mm256_store_ps(lo + 8 * v, _mm256_sub_ps(a, d));
          _mm256_store_ps(hi + 8 * v, _mm256_add_ps(a, d));
          reach |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(hi + 8 * v), bar, _CMP_GE_OQ)) << (8 * v);
        }
        if (reach == 0) continue;  // the common case: no column of this panel can reach the row's best
        for (int64_t i = 0; i < cols; ++i) row.add(col0 + i, lo[i], hi[i]);
      }
    }
  }
}
#endif

// Row r's candidates from every thread's RowScreen: upper bound >= the best lower bound of all,
// in column order.
std::vector<int64_t> candidates(const std::vector<std::vector<RowScreen>>& parts, int64_t r) {
  float bar = -INFINITY;
  for (const auto& part : parts)
    if (!part.empty()) bar = std::max(bar, part[r].bar);
  std::vector<int64_t> out;
  for (const auto& part : parts)
    if (!part.empty())
      for (const auto& [col, hi] : part[r].cols)
        if (hi >= bar) out.push_back(col);
  std::sort(out.begin(), out.end());
  return out;
}

// The fp32 logits of columns cols[0 .. n) for row x, as the panel kernel computes them: one fma
// chain over k from +0 (each vector lane of the kernel does exactly this for its column), then
// + bias. The weights are read from the plain [N, K] matrix, where a column's K floats are
// contiguous (from the panels, each of its K floats would be a cache line of its own). Eight
// columns at a time, so eight chains are in flight.
void exact_logits(const float* x, int64_t K, const float* weight, const int64_t* cols, int64_t n, const float* bias,
                  float* out) {
  constexpr int kChains = 8;
  for (int64_t i0 = 0; i0 < n; i0 += kChains) {
    const int64_t m = std::min<int64_t>(kChains, n - i0);
    const float* w[kChains];
    float acc[kChains];
    for (int64_t i = 0; i < kChains; ++i) {
      w[i] = weight + cols[i0 + std::min<int64_t>(i, m - 1)] * K;
      acc[i] = 0.f;
    }
    for (int64_t k = 0; k < K; ++k)
      for (int i = 0; i < kChains; ++i) acc[i] = std::fma(x[k], w[i][k], acc[i]);
    for (int64_t i = 0; i < m; ++i) out[i0 + i] = bias != nullptr ? acc[i] + bias[cols[i0 + i]] : acc[i] + 0.f;
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& screen, const std::vector<const at::Tensor*>& per_column,
                  const at::Tensor& weight, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "screened_argmax: x must be a float32 CPU [M, K] tensor with contiguous rows");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "screened_argmax: K must be a multiple of ", kGroup, ", got ", K);
  TORCH_CHECK(screen.scalar_type() == at::kByte && screen.is_contiguous() && screen.dim() == 3 &&
              screen.size(0) == (N + kScreenCols - 1) / kScreenCols && screen.size(1) == K / 4 && screen.size(2) == 64,
              "screened_argmax: screen must be [ceil(N/16), K/4, 64] uint8");
  for (const at::Tensor* t : per_column)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N,
                "screened_argmax: scales and bounds must be contiguous float32 [N]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
              weight.size(0) == N && weight.size(1) == K, "screened_argmax: weight must be a contiguous float32 [N, K]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "screened_argmax: bias must be a contiguous float32 [N]");
}

}  // namespace

// For each row of x [M, K]: the column of x W^T + b ranked first, as packed_linear_argmax gives
// it, screened in int8 first (see the top of this file).
//   screen      [ceil(N / 16), K / 4, 64] uint8   (models/cpu_linear.py: screen_weight_stats)
//   scales      [N] float32  s_i
//   bound_err   [N] float32  e'_i: ||w_i - s_i q_i|| plus the rounding slack
//   bound_norm  [N] float32  f'_i: ||s_i q_i||, rounded up
//   bound_bias  [N] float32  c_i: the rounding of b_i
//   weight      W [N, K] float32, row-major: the candidates' exact products
//   panels      pack_linear_weight(W): for the rows the screen hands back (packed_linear_argmax)
//   max_candidates: rows with more candidates take packed_linear_argmax
at::Tensor screened_argmax(const at::Tensor& x, const at::Tensor& screen, const at::Tensor& scales,
                           const at::Tensor& bound_err, const at::Tensor& bound_norm, const at::Tensor& bound_bias,
                           const at::Tensor& weight, const at::Tensor& panels, int64_t N,
                           const std::optional<at::Tensor>& bias, int64_t max_candidates) {
  check_inputs(x, screen, {&scales, &bound_err, &bound_norm, &bound_bias}, weight, N, bias);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
#ifndef MINIVLLM_HAVE_SCREEN
  (void)max_candidates;
  return packed_linear_argmax(x, panels, N, bias);
#else
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const Screen sc{screen.data_ptr<uint8_t>(), scales.data_ptr<float>(), bound_err.data_ptr<float>(),
                  bound_norm.data_ptr<float>(), bound_bias.data_ptr<float>(), bp, N, K};
  const QuantRows q = quantize_rows(xp, ldx, M, K);

  // 1. the screen: each thread takes chunks of panels from a shared counter, in column order,
  // into its own RowScreen per row. Not static halves: a thread whose columns rarely reach its
  // rows' bar (on SmolLM2, the upper half of the vocabulary, whose logits are low) keeps adding
  // columns to its candidate lists before its bar rises, and ran ~40 % longer than the other
  // (32 rows: 11.0 -> 8.4 ms with the chunks, docs/perf.md session 10).
  const int64_t threads = at::get_num_threads(), P = screen.size(0);
  const int64_t chunk = std::max<int64_t>(16, P / (16 * threads));  // ~16 chunks a thread
  std::vector<std::vector<RowScreen>> parts(threads);
  std::atomic<int64_t> next_panel{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      parts[t].resize(M);
      for (int64_t c = next_panel.fetch_add(chunk); c < P; c = next_panel.fetch_add(chunk))
        screen_panels(sc, q, M, c, std::min(P, c + chunk), parts[t]);
    }
  });

  // 2. each row's candidates, then their exact logits; the rows the screen cannot narrow (or with
  // a non-finite feature) are answered by the exact kernel
  std::vector<std::vector<int64_t>> cand(M);
  std::vector<int64_t> fallback;
  for (int64_t r = 0; r < M; ++r) {
    cand[r] = candidates(parts, r);
    if (!q.finite[r] || cand[r].empty() || static_cast<int64_t>(cand[r].size()) > max_candidates) {
      cand[r].clear();
      fallback.push_back(r);
    }
  }
  int64_t* op = out.data_ptr<int64_t>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits;
    for (int64_t r = begin; r < end; ++r) {
      if (cand[r].empty()) continue;
      logits.resize(cand[r].size());
      exact_logits(xp + r * ldx, K, wp, cand[r].data(), cand[r].size(), bp, logits.data());
      int64_t best = 0;  // columns in increasing order: only a strict win replaces (torch's tie order)
      for (int64_t i = 1; i < static_cast<int64_t>(logits.size()); ++i)
        if (logits[i] > logits[best]) best = i;
      op[r] = cand[r][best];
    }
  });
  if (!fallback.empty()) {
    const at::Tensor idx = at::tensor(fallback, x.options().dtype(at::kLong));
    const at::Tensor got = packed_linear_argmax(x.index_select(0, idx).contiguous(), panels, N, bias);
    for (size_t i = 0; i < fallback.size(); ++i) op[fallback[i]] = got.data_ptr<int64_t>()[i];
  }
  return out;
#endif
}

// Whether this build has the int8 screen (AVX2); without it screened_argmax is packed_linear_argmax.
bool screened_argmax_available() {
#ifdef MINIVLLM_HAVE_SCREEN
  return true;
#else
  return false;
#endif
}

MINIVLLM_FRAGMENT(MINIVLLM_OPS_NAMESPACE, m) {
  m.def("screened_argmax_available() -> bool", &screened_argmax_available);
  m.def("screened_argmax(Tensor x, Tensor screen, Tensor scales, Tensor bound_err, Tensor bound_norm, "
        "Tensor bound_bias, Tensor weight, Tensor panels, int N, Tensor? bias, int max_candidates) -> Tensor");
}

MINIVLLM_LIBRARY_IMPL(MINIVLLM_OPS_NAMESPACE, CPU, m) { m.impl("screened_argmax", &screened_argmax); }
