// What the memory system gives a plain read on this CPU: 300 MB read by OpenMP threads in chunks
// of 4 KB .. 1 MB, in order or shuffled, with or without software prefetch of the chunk `pf`
// chunks ahead. The yardstick for the decode attention kernel, which reads each sequence's K/V
// blocks (12 KB a block for SmolLM2) where they lie (docs/perf.md, session 8).
//
//   g++ -O3 -mavx2 -mfma -fopenmp scripts/cpu_read_bandwidth.cpp -o /tmp/bw && OMP_NUM_THREADS=2 /tmp/bw
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main() {
  const size_t total = 300ul << 20;
  float* buf = static_cast<float*>(aligned_alloc(4096, total));
  std::fill(buf, buf + total / 4, 1.f);
  for (size_t chunk : {4096ul, 12288ul, 65536ul, 1ul << 20}) {
    const size_t n = total / chunk;
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    for (int shuffled = 0; shuffled < 2; ++shuffled) {
      if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(1));
      for (size_t pf : {0ul, 2ul, 8ul}) {
        double best = 1e9, sink = 0;
        for (int rep = 0; rep < 4; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          float s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
          for (size_t i = 0; i < n; ++i) {
            if (pf && i + pf < n) {
              const char* ahead = reinterpret_cast<const char*>(buf + order[i + pf] * chunk / 4);
              for (size_t line = 0; line < std::min<size_t>(chunk, 65536); line += 64)
                _mm_prefetch(ahead + line, _MM_HINT_T1);
            }
            const float* p = buf + order[i] * chunk / 4;
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
            for (size_t j = 0; j < chunk / 4; j += 16) {
              a = _mm256_add_ps(a, _mm256_load_ps(p + j));
              b = _mm256_add_ps(b, _mm256_load_ps(p + j + 8));
            }
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, _mm256_add_ps(a, b));
            s += lanes[0];
          }
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          sink += s;
        }
        std::printf("chunk %7zu %s prefetch %zu ahead: %.1f GB/s (%g)\n", chunk, shuffled ? "shuffled" : "in order",
                    pf, total / best / 1e9, sink);
      }
    }
  }
}
