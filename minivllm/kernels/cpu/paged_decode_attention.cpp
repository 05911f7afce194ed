// Paged decode attention for the CPU, float32: one query token per sequence, reading each
// sequence's K/V blocks where they lie in the cache (the plain-PyTorch path copies them out
// with index_select every layer, then runs SDPA over the copy).
//
// Shapes (all float32 except the int32 tables):
//   query        [B, Hq, D]   stride(1) == D, stride(2) == 1 (rows may be strided)
//   k/v_cache    [num_blocks, block_size, Hk, D] contiguous
//   block_tables [B, max_blocks] int32, last dim contiguous
//   seq_lens     [B] int32, >= 1: keys 0 .. seq_lens[b] - 1 of sequence b
//   out          [B, Hq, D] contiguous
// Query head j reads KV head j / (Hq / Hk) (grouped-query attention).
//
// Work split: one task per (sequence, KV head), spread over torch's intra-op threads by
// at::parallel_for. A task loads its G = Hq / Hk query heads once, then makes two passes over
// the keys: scores (q . k * scale, with the running max), then exp and the weighted sum of V.
// A thread runs the score passes of a sequence's tasks, then their value passes; the scores
// live in a per-thread buffer (Hk * G * seq_len floats).
//
// Built at first use by minivllm/kernels/cpu_kernels.py with torch.utils.cpp_extension.
// Built with AVX-512 (-mavx512f) or AVX2 + FMA (-mavx2 -mfma), D = 64 or 128 and G <= 8 take
// the vectorized path (one template over the ISA, vec_math.h); everything else takes the
// portable loop. The tests build and check every variant this CPU can run.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "op_library.h"
#include "vec_math.h"

namespace {

struct Task {
  const float* q;        // [G, D] query heads of this KV head
  const float* k;        // k_cache offset to this KV head: token slot s is at k + s * slot_stride
  const float* v;
  const int32_t* table;  // this sequence's block ids
  int64_t len;           // keys to attend to
  float* out;            // [G, D]
  // floats of each token slot after this head's D, i.e. the later KV heads' rows, to fetch into
  // L2 as the task reads its own (0: none). See paged_decode_attention.
  int64_t fetch_rest = 0;
};

// the most K (or V) bytes of one sequence its first head's task fetches for the others: 3/4 of a
// Zen 3 core's L2 (512 KB), leaving room for the rest of the tasks' data
constexpr int64_t kFetchRestBytes = 384 * 1024;

struct Shape {
  int64_t G, D, block_size, slot_stride;  // slot_stride = Hk * D floats between token slots
  float scale;
};

// What a call of a task's attend function does: the score pass (scores, then softmax in place
// in the task's score buffer), the value pass (the weighted sum of V from those scores), or both.
enum Phase : int { kScores = 1, kValues = 2 };

inline int64_t slot_of(const int32_t* table, int64_t t, int64_t block_size) {
  return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
}

// fn(t, row) for keys t = 0 .. len - 1 in order, row = base + slot(t) * slot_stride: block by
// block, with no division per key (two per key cost as much as the arithmetic of a key)
template <class Fn>
inline void for_each_key(const float* base, const int32_t* table, int64_t len, int64_t block_size,
                         int64_t slot_stride, Fn&& fn) {
  for (int64_t first = 0, b = 0; first < len; first += block_size, ++b) {
    const float* row = base + static_cast<int64_t>(table[b]) * block_size * slot_stride;
    const int64_t last = std::min(len, first + block_size);
    for (int64_t t = first; t < last; ++t, row += slot_stride) fn(t, row);
  }
}

// The portable path: plain loops, std::exp. Scores of the task's G heads into scores [G, len],
// softmax in place.
void portable_scores(const Task& task, const Shape& s, float* scores) {
  const int64_t G = s.G, D = s.D, len = task.len;
  for (int64_t t = 0; t < len; ++t) {
    const float* k = task.k + slot_of(task.table, t, s.block_size) * s.slot_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* q = task.q + g * D;
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[d] * k[d];
      scores[g * len + t] = acc * s.scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    const float m = *std::max_element(sg, sg + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

// The weighted sum of V from portable_scores' probabilities.
void portable_values(const Task& task, const Shape& s, const float* scores) {
  const int64_t G = s.G, D = s.D, len = task.len;
  std::fill(task.out, task.out + G * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const float* v = task.v + slot_of(task.table, t, s.block_size) * s.slot_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * len + t];
      float* o = task.out + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
    }
  }
}

void attend_portable(const Task& task, const Shape& s, float* scores, int phases) {
  if (phases & kScores) portable_scores(task, s, scores);
  if (phases & kValues) portable_values(task, s, scores);
}

#ifdef MINIVLLM_HAVE_VEC
// softmax in place over scores[0 .. len) given their max (tail past the last full vector: std::exp)
template <class V>
inline void softmax_row(float* sg, int64_t len, float max) {
  constexpr int W = V::kWidth;
  const typename V::T m = V::set1(max);
  typename V::T sum = V::zero();
  int64_t t = 0;
  for (; t + W <= len; t += W) {
    const typename V::T e = V::exp(V::sub(V::load(sg + t), m));
    V::store(sg + t, e);
    sum = V::add(sum, e);
  }
  float total = V::reduce_add(sum);
  for (int64_t u = t; u < len; ++u) {
    sg[u] = std::exp(sg[u] - max);
    total += sg[u];
  }
  const float inv = 1.f / total;
  const typename V::T vinv = V::set1(inv);
  for (t = 0; t + W <= len; t += W) V::store(sg + t, V::mul(V::load(sg + t), vinv));
  for (; t < len; ++t) sg[t] *= inv;
}

// Vectors of the output rows accumulated per pass over V: all G heads' accumulators of a pass stay
// in registers (16 ymm with AVX2, 32 zmm with AVX-512, leaving room for the broadcasts). With
// the whole row at once (G = 3, D = 64: 24 ymm) they lived on the stack, and every FMA became
// a load and a store: the V pass ran ~3x slower than its arithmetic.
template <class V, int C, int G>
constexpr int vectors_per_v_pass() {
  constexpr int budget = V::kWidth == 16 ? 24 : 12;
  int n = C;
  while (n > 1 && n * G > budget) n /= 2;
  return n;
}

// C = D / W vectors per head row, G query heads (both compile-time, so loops unroll and the
// accumulators can live in registers). The score pass: scores of the task's G heads into
// sc [G, len], softmax in place.
template <class V, int C, int G>
void vec_scores(const Task& task, const Shape& s, float* sc) {
  using T = typename V::T;
  constexpr int W = V::kWidth;
  constexpr int64_t D = C * W;
  static_assert(C % 2 == 0, "the score pass splits each dot product in two chains");
  const int64_t len = task.len, rest = task.fetch_rest;
  alignas(64) float qs[G][D];  // the scaled queries, read from L1 as the FMAs' memory operands
  float mx[G];
  for (int g = 0; g < G; ++g) {
    mx[g] = -INFINITY;
    for (int c = 0; c < C; ++c) V::store(qs[g] + c * W, V::mul(V::load(task.q + g * D + c * W), V::set1(s.scale)));
  }
  // scores, one key at a time for all G heads (each K vector loaded once), each dot product in
  // two chains then one horizontal sum. Key by key, every load instruction steps one slot
  // (Hk * D floats) a key, a stride the hardware prefetcher follows; the earlier order (8 keys
  // of one block per head, reduced together by one hadd tree) stepped 8 slots, 6 KB with
  // SmolLM2's heads, and waited on memory: this pass over cold K went 9.8 -> 7.0 ms for W5's 32
  // decode rows x 30 layers (docs/perf.md, session 9).
  for_each_key(task.k, task.table, len, s.block_size, s.slot_stride, [&](int64_t t, const float* k) {
    // the later heads' rows of this slot (see paged_decode_attention), a 64-byte line at a time
    for (int64_t f = D; f < D + rest; f += 16) _mm_prefetch(reinterpret_cast<const char*>(k + f), _MM_HINT_T1);
    T a[G][2];
    for (int g = 0; g < G; ++g) {
      a[g][0] = V::mul(V::load(qs[g]), V::load(k));
      a[g][1] = V::mul(V::load(qs[g] + W), V::load(k + W));
    }
    for (int c = 2; c < C; c += 2) {
      const T k0 = V::load(k + c * W), k1 = V::load(k + (c + 1) * W);
      for (int g = 0; g < G; ++g) {
        a[g][0] = V::fmadd(V::load(qs[g] + c * W), k0, a[g][0]);
        a[g][1] = V::fmadd(V::load(qs[g] + (c + 1) * W), k1, a[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const float x = V::reduce_add(V::add(a[g][0], a[g][1]));
      sc[g * len + t] = x;
      mx[g] = std::max(mx[g], x);
    }
  });
  for (int g = 0; g < G; ++g) softmax_row<V>(sc + g * len, len, mx[g]);
}

// The value pass: the weighted sum of V from vec_scores' probabilities.
template <class V, int C, int G>
void vec_values(const Task& task, const Shape& s, const float* sc) {
  using T = typename V::T;
  constexpr int W = V::kWidth;
  constexpr int64_t D = C * W;
  const int64_t len = task.len, rest = task.fetch_rest;
  constexpr int P = vectors_per_v_pass<V, C, G>();
  for (int c0 = 0; c0 < C; c0 += P) {  // vectors c0 .. c0 + P - 1 of every head's output row
    T o[G][P];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < P; ++c) o[g][c] = V::zero();
    // the first pass also fetches what the later passes (vectors P .. C - 1) and the later heads'
    // tasks will read of each V slot
    const int64_t fetch_end = c0 == 0 ? D + rest : 0;
    for_each_key(task.v + c0 * W, task.table, len, s.block_size, s.slot_stride, [&](int64_t t, const float* v) {
      for (int64_t f = P * W; f < fetch_end; f += 16) _mm_prefetch(reinterpret_cast<const char*>(v + f), _MM_HINT_T1);
      for (int g = 0; g < G; ++g) {
        const T p = V::set1(sc[g * len + t]);
        for (int c = 0; c < P; ++c) o[g][c] = V::fmadd(p, V::load(v + c * W), o[g][c]);
      }
    });
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < P; ++c) V::store(task.out + g * D + (c0 + c) * W, o[g][c]);
  }
}

template <class V, int C, int G>
void attend_vec(const Task& task, const Shape& s, float* sc, int phases) {
  if (phases & kScores) vec_scores<V, C, G>(task, s, sc);
  if (phases & kValues) vec_values<V, C, G>(task, s, sc);
}

// attend_vec for head dim D and G = 1 .. 8 (nullptr for other G)
template <class V, int D>
void* attend_vec_for_group(int64_t G) {
  constexpr int C = D / V::kWidth;
  using Fn = void (*)(const Task&, const Shape&, float*, int);
  constexpr Fn table[9] = {nullptr,          attend_vec<V, C, 1>, attend_vec<V, C, 2>, attend_vec<V, C, 3>,
                           attend_vec<V, C, 4>, attend_vec<V, C, 5>, attend_vec<V, C, 6>, attend_vec<V, C, 7>,
                           attend_vec<V, C, 8>};
  return G >= 1 && G <= 8 ? reinterpret_cast<void*>(table[G]) : nullptr;
}
#endif

using AttendFn = void (*)(const Task&, const Shape&, float*, int);

AttendFn pick_path(int64_t G, int64_t D) {
#ifdef MINIVLLM_HAVE_VEC
  using V = minivllm_vec::VecBest;
  void* fn = D == 64 ? attend_vec_for_group<V, 64>(G) : D == 128 ? attend_vec_for_group<V, 128>(G) : nullptr;
  if (fn != nullptr) return reinterpret_cast<AttendFn>(fn);
#endif
  (void)G;
  (void)D;
  return attend_portable;
}

void check_inputs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& out) {
  for (const at::Tensor* t : {&query, &k_cache, &v_cache, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "paged_decode_attention: float32 CPU tensors only");
  }
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_decode_attention: query must be [B, Hq, D] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "paged_decode_attention: caches must be contiguous [N, bs, Hk, D]");
  TORCH_CHECK(k_cache.size(3) == query.size(2) && query.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: head_dim must match and Hq must be a multiple of Hk");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
              block_tables.size(0) == query.size(0), "paged_decode_attention: block_tables must be int32 [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == query.size(0),
              "paged_decode_attention: seq_lens must be int32 [B]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "paged_decode_attention: out must be contiguous like query");
  // every block a sequence reads must exist: a bad id would read outside the cache
  const int64_t bs = k_cache.size(1), num_blocks = k_cache.size(0), max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < query.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && (lens[b] + bs - 1) / bs <= max_blocks, "paged_decode_attention: seq_lens[", b,
                "] = ", lens[b], " outside [1, ", max_blocks * bs, "]");
    const int32_t* row = block_tables.data_ptr<int32_t>() + b * block_tables.stride(0);
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, "paged_decode_attention: block id ", row[i], " of sequence ", b,
                  " outside [0, ", num_blocks, ")");
  }
}

// Task ranges [bounds[j], bounds[j + 1]) of about equal work, one per thread: tasks i = b * Hk + h
// cost their sequence's key count (plus a little fixed work). Decode rows differ in length (W5:
// 60 to 330 keys), so equal task counts left one thread waiting on the other.
std::vector<int64_t> split_by_keys(const int32_t* lens, int64_t B, int64_t Hk, int64_t parts) {
  constexpr int64_t kTaskOverhead = 16;  // keys' worth of work a task costs besides its keys
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += Hk * (lens[b] + kTaskOverhead);
  parts = std::max<int64_t>(1, std::min(parts, B * Hk));
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t i = 0; i < B * Hk; ++i) {
    done += lens[i / Hk] + kTaskOverhead;
    // close a part once it holds its share (the last part takes what is left)
    if (static_cast<int64_t>(bounds.size()) < parts && done * parts >= total * static_cast<int64_t>(bounds.size()))
      bounds.push_back(i + 1);
  }
  bounds.push_back(B * Hk);
  return bounds;
}

}  // namespace

void paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            at::Tensor& out) {
  check_inputs(query, k_cache, v_cache, block_tables, seq_lens, out);
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2), Hk = k_cache.size(2);
  const Shape shape{Hq / Hk, D, k_cache.size(1), Hk * D, static_cast<float>(scale)};
  const AttendFn attend = pick_path(shape.G, D);
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t q_row = query.stride(0), t_row = block_tables.stride(0);
  const std::vector<int64_t> bounds = split_by_keys(lens, B, Hk, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // reused by this thread's tasks
    // the thread's tasks grouped by sequence: all score passes of a group, then its value passes
    for (int64_t first = bounds[begin], last; first < bounds[end]; first = last) {
      const int64_t b = first / Hk, len = lens[b];
      last = std::min(bounds[end], (b + 1) * Hk);
      scores.resize((last - first) * shape.G * len);
      // A sequence's tasks each read every key's slot, but only their own D floats of its
      // Hk * D: a strided walk (SmolLM2: 4 of every 12 lines) that reads memory ~20 % slower
      // than whole blocks (docs/perf.md, session 10). So where this thread has all Hk tasks of
      // the sequence, the first one's passes fetch the rest of each slot into L2, and the
      // others' passes, which come right after, read it from there; where the sequence's K (or
      // V) fits in kFetchRestBytes (SmolLM2: 512 keys): longer, it would be evicted first.
      const bool whole = first % Hk == 0 && last - first == Hk;
      const bool fits = len * shape.slot_stride * static_cast<int64_t>(sizeof(float)) <= kFetchRestBytes;
      for (const int phase : {kScores, kValues})
        for (int64_t i = first; i < last; ++i) {
          const int64_t h = i % Hk;
          const int64_t rest = i == first && whole && fits ? (Hk - 1) * D : 0;
          const Task task{q + b * q_row + h * shape.G * D, kc + h * D, vc + h * D, tables + b * t_row, len,
                          o + (b * Hq + h * shape.G) * D, rest};
          attend(task, shape, scores.data() + (i - first) * shape.G * len, phase);
        }
    }
  });
}

// "avx512", "avx2" or "portable": the vector paths this build has
std::string vector_isa() { return MINIVLLM_VECTOR_ISA; }

MINIVLLM_FRAGMENT(MINIVLLM_OPS_NAMESPACE, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("vector_isa() -> str", &vector_isa);
}

MINIVLLM_LIBRARY_IMPL(MINIVLLM_OPS_NAMESPACE, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
