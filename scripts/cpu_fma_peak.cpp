// The CPU's float32 FMA peak with AVX2: 12 independent chains of 8-wide FMAs per thread, on 1 and
// 2 threads. The ceiling that the CPU linear kernels are measured against (docs/perf.md, session 7).
//
//   g++ -O3 -funroll-loops -mavx2 -mfma -fopenmp scripts/cpu_fma_peak.cpp -o /tmp/fma_peak && /tmp/fma_peak
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <omp.h>
int main() {
  const long iters = 200000000;
  for (int threads = 1; threads <= 2; ++threads) {
    auto t0 = std::chrono::steady_clock::now();
    float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+:sink)
    {
      __m256 a[12];
      for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(i * 0.001f);
      const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
      for (long n = 0; n < iters; ++n)
        for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
      __m256 s = a[0];
      for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
      float out[8]; _mm256_storeu_ps(out, s); sink += out[0];
    }
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("threads %d: %.1f GFLOP/s (sink %f)\n", threads, threads * iters * 12.0 * 16 / sec / 1e9, sink);
  }
}
