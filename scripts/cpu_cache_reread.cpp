// How much of a buffer one core finds again in its caches: read it once (warm), then time a
// second read, for buffers of 1 .. 64 MB, after flushing with a 256 MB read. Where the second read
// falls to the DRAM rate is what the caches actually hold for this core (on the project's 2-core
// AMD EPYC VM: ~8-12 MB, though lscpu reports a 32 MB L3; docs/perf.md, session 10).
//
//   g++ -O3 -mavx2 scripts/cpu_cache_reread.cpp -o /tmp/reread && /tmp/reread
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

// the sum of a buffer, four independent accumulators so the adds do not bound the read rate
static __m256 read_all(const std::vector<float>& a, __m256 s) {
  __m256 s0 = s, s1 = _mm256_setzero_ps(), s2 = s1, s3 = s1;
  for (size_t i = 0; i + 32 <= a.size(); i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(&a[i]));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(&a[i + 8]));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(&a[i + 16]));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(&a[i + 24]));
  }
  return _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
}

int main() {
  std::vector<float> flush((256u << 20) / 4, 1.f);
  for (size_t mb : {1, 2, 4, 8, 12, 16, 24, 32, 64}) {
    std::vector<float> a((mb << 20) / 4, 1.f);
    double best = 0;
    __m256 s = _mm256_setzero_ps();
    for (int rep = 0; rep < 5; ++rep) {
      s = read_all(flush, s);
      s = read_all(a, s);  // the first read brings it in
      const auto t = std::chrono::steady_clock::now();
      s = read_all(a, s);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
      best = std::max(best, (mb << 20) / dt / 1e9);
    }
    float sink[8];
    _mm256_storeu_ps(sink, s);
    std::printf("%3zu MB: second read %.1f GB/s (%g)\n", mb, best, sink[0]);
  }
}
