// Vector math shared by the CPU kernels: one name per operation over the ISA, so each kernel is
// written once as a template: Vec512 (AVX-512, 16 floats) and Vec256 (AVX2 + FMA, 8 floats).
// VecBest is the widest the build has; portable builds have neither (and use std::exp).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace minivllm_vec {

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
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
  static T fnmadd(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
  static T exp(T x);  // below
  static float reduce_add(T v) { return _mm512_reduce_add_ps(v); }
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
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }   // a * b + c
  static T fnmadd(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
  static T exp(T x);  // below
  static float reduce_add(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// exp(x) = 2^n exp(r) with n = round(x / ln2) and r = x - n ln2, |r| <= ln2 / 2 (ln2 split in two
// so r is exact enough); this returns exp(r) from a degree-6 polynomial (relative error ~2e-7).
// Each ISA's exp clamps x, rounds n and scales by 2^n its own way.
template <class V>
inline typename V::T exp_of_remainder(typename V::T x, typename V::T n) {
  typename V::T r = V::fnmadd(n, V::set1(0.693359375f), x);
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  typename V::T p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  return V::fmadd(p, V::mul(r, r), V::add(r, V::set1(1.f)));
}
#endif

#ifdef __AVX512F__
// Below -87.3 the input is clamped there (the true result is ~0 or denormal); scalef gives inf
// above ~88.7.
inline Vec512::T Vec512::exp(T x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_of_remainder<Vec512>(x, n), n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Clamped below at -87.3 as above; 2^n is built in the exponent bits, so the input is also
// clamped above at 88.3 (n <= 127): results there saturate at ~2.1e38 instead of inf.
inline Vec256::T Vec256::exp(T x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(exp_of_remainder<Vec256>(x, n), _mm256_castsi256_ps(bits));
}
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

// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u over n floats (fused_ops.cpp's silu_mul and
// packed_linear.cpp's gate-up epilogue: one formula, so both give the same bits)
inline void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
#ifdef MINIVLLM_HAVE_VEC
  using V = VecBest;
  for (; i + V::kWidth <= n; i += V::kWidth) {
    const V::T x = V::load(g + i);
    const V::T e = V::exp(V::sub(V::zero(), x));  // exp(-x): inf (AVX-512) or ~2e38 (AVX2) for x < -88.3
    const V::T s = V::div(x, V::add(V::set1(1.f), e));
    V::store(out + i, V::mul(s, V::load(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

}  // namespace minivllm_vec
