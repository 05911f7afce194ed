// Vector math shared by the CPU kernels: exp of a full vector, for AVX-512 builds (16 floats)
// and AVX2 + FMA builds (8 floats). Portable builds use std::exp.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace minivllm_vec {

// Both versions: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so r is exact enough),
// exp(r) from a degree-6 polynomial (relative error ~2e-7), times 2^n. Below -87.3 the input
// is clamped there (the true result is ~0 or denormal).
#define MINIVLLM_EXP_POLY(set1, fmadd, fnmadd, mul, add, x, n, p)            \
  auto r = fnmadd(n, set1(0.693359375f), x);                       \
  r = fnmadd(n, set1(-2.12194440e-4f), r);                                   \
  p = set1(1.9875691500e-4f);                                                \
  p = fmadd(p, r, set1(1.3981999507e-3f));                                   \
  p = fmadd(p, r, set1(8.3334519073e-3f));                                   \
  p = fmadd(p, r, set1(4.1665795894e-2f));                                   \
  p = fmadd(p, r, set1(1.6666665459e-1f));                                   \
  p = fmadd(p, r, set1(5.0000001201e-1f));                                   \
  p = fmadd(p, mul(r, r), add(r, set1(1.f)));

#ifdef __AVX512F__
// 16 floats; scalef gives inf above ~88.7.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 p;
  MINIVLLM_EXP_POLY(_mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps, _mm512_add_ps, x, n, p)
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 floats; 2^n is built in the exponent bits, so the input is also clamped above at 88.3
// (n <= 127): results there saturate at ~2.1e38 instead of overflowing to inf.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 p;
  MINIVLLM_EXP_POLY(_mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps, _mm256_add_ps, x, n, p)
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// [sum(a[0]), ..., sum(a[7])]: an hadd tree, then the two 128-bit halves added
inline __m256 reduce_add_8x256(const __m256 a[8]) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

inline float reduce_add256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#undef MINIVLLM_EXP_POLY

// One name per operation for the vector kernels, so each is written once as a template over
// the ISA: Vec512 (16 floats) and Vec256 (8 floats, AVX2 + FMA).
#ifdef __AVX512F__
struct Vec512 {
  using T = __m512;
  static constexpr int kWidth = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T zero() { return _mm512_setzero_ps(); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T exp(T x) { return exp512(x); }
  static float reduce_add(T v) { return _mm512_reduce_add_ps(v); }
  // the sums of 8 vectors, as 8 floats
  static __m256 reduce_add_8(const T a[8]) {
    __m256 h[8];
    for (int j = 0; j < 8; ++j)
      h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
    return reduce_add_8x256(h);
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct Vec256 {
  using T = __m256;
  static constexpr int kWidth = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T zero() { return _mm256_setzero_ps(); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T exp(T x) { return exp256(x); }
  static float reduce_add(T v) { return reduce_add256(v); }
  static __m256 reduce_add_8(const T a[8]) { return reduce_add_8x256(a); }
};
#endif

// The widest the build has (undefined in portable builds).
#if defined(__AVX512F__)
using VecBest = Vec512;
#define MINIVLLM_HAVE_VEC 1
#define MINIVLLM_VECTOR_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
using VecBest = Vec256;
#define MINIVLLM_HAVE_VEC 1
#define MINIVLLM_VECTOR_ISA "avx2"
#else
#define MINIVLLM_VECTOR_ISA "portable"
#endif

}  // namespace minivllm_vec
