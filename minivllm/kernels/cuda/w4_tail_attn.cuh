// The W4 layer tail's attention stage (IN_ATTN): the decode token's attention for one layer inside
// the persistent launch, before its o_proj stage, so that the ring streams o's and gate_up's tiles
// while attention runs (a separate attention kernel is a boundary the HBM idles through: ~7 us a
// layer, docs/perf.md 2026-11-29, leases 74-75).
//
// It computes what kernels/decode_attention.py's split kernel computes for one sequence of one new
// token, with the same chunks and the same steps: the context is cut into chunks of
//   chunk = max(min_chunk, round_up(cdiv(seq_len, splits), TK))
// keys (splits and min_chunk as that kernel's launch has them); a work item is (kv head, chunk);
// over each TK-key tile an online softmax in the log2 domain (s = (q . k) qk_scale; m, l; p = 2^(s -
// m); acc = acc 2^(m_old - m) + fp16(p) . v); a chunk's normalized output and log-sum-exp go to
// `part`, and the last item of a kv head to finish merges them (sum_c 2^(lse_c - max) o_c /
// sum_c 2^(lse_c - max)). One chunk: the output directly (what the merge of one chunk gives).
// The sums run in another order than the tensor cores' there: equal to float32 rounding, not bit
// for bit.
//
// Shapes: ATT_G = 4 query heads a kv head, head dim ATT_D = 128, fp16 caches [blocks, block_size,
// kv_heads, 128] (kv head and slot strides given), int32 block table. Counting: the head's merging
// block adds one to the stage's counter once its outputs are stored; the next stage waits for
// kv_heads. Included by w4_layer_tail.cu inside its namespace (CONSUMERS, consumer_sync). Every
// read of q, the caches and the block table goes through L2 (.cg): the previous launch wrote this
// token's K/V, and this kernel may have started (PDL) before it ended.
#pragma once

constexpr int ATT_G = 4;     // query heads a kv head
constexpr int ATT_D = 128;   // head dim
constexpr int ATT_TK = 128;  // keys a tile: decode_attention's BLOCK_N for 128-dim fp16 rows
#ifndef ATT_KB
#define ATT_KB 8             // K rows a lane has in flight at once
#endif
#ifndef ATT_VB
#define ATT_VB 16            // V values a thread has in flight at once
#endif
// shared memory (floats, inside the stage-input row xs): q, scores, the running output, the
// four key quarters' PV sums, the tile's cache blocks, m, l, alpha and a broadcast slot
constexpr int ATT_SMEM_FLOATS = ATT_G * ATT_D * 3 + 4 * ATT_G * ATT_D + 2 * ATT_TK + 3 * ATT_G + 1;

struct Attn {
  const __half* q;           // [kv_heads * ATT_G * ATT_D] the token's rotated q (qkv's first values)
  const __half* k_cache;     // [blocks, block_size, kv_heads, ATT_D]
  const __half* v_cache;     // the same strides
  long long stride_block, stride_slot, stride_head;  // elements
  const int* block_table;    // [max_blocks] the sequence's row
  const int* seq_len;        // [1] keys, this token's included
  float* part;               // [kv_heads][splits][ATT_G][ATT_D + 1]: normalized output, then lse (log2)
  int* head_counts;          // [kv_heads] chunks done, 0 on entry and on exit
  __half* out;               // [kv_heads * ATT_G * ATT_D]
  float qk_scale;            // softmax scale * log2(e)
  int block_size, kv_heads, splits, min_chunk;
};

__device__ inline float ex2(float x) { float y; asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ inline float lg2(float x) { float y; asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

__device__ inline int att_chunk(const Attn& A, int seq_len) {
  const int share = (seq_len + A.splits - 1) / A.splits;
  return max(A.min_chunk, (share + ATT_TK - 1) / ATT_TK * ATT_TK);
}

// One tile's scores: warp w takes keys n0 + 16w .. + 15 (lane l: dims 4l .. 4l + 3 of each), ATT_KB
// rows' loads in flight at once; sc[g][key] = (q_g . k) qk_scale, -inf past `end`. rows[key]: the
// key's row offset in the caches (elements, this kv head's), for the PV pass too.
__device__ inline void att_scores(const Attn& A, int head, int n0, int end, const float* qf, float* sc,
                                  long long* rows) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float qv[ATT_G][4];  // this lane's 4 dims of each query head
#pragma unroll
  for (int g = 0; g < ATT_G; ++g)
#pragma unroll
    for (int e = 0; e < 4; ++e) qv[g][e] = qf[g * ATT_D + 4 * lane + e];
  const int key0 = 16 * warp;
  if (lane < 16) {
    const int p = n0 + key0 + lane;
    long long row = 0;
    if (p < end) row = __ldcg(A.block_table + p / A.block_size) * A.stride_block + (p % A.block_size) * A.stride_slot;
    rows[key0 + lane] = row + head * A.stride_head;
  }
  __syncwarp();
#pragma unroll
  for (int k0 = 0; k0 < 16; k0 += ATT_KB) {  // batches of ATT_KB rows in flight (the register budget)
  uint2 kr[ATT_KB];
#pragma unroll
  for (int kk = 0; kk < ATT_KB; ++kk) {
    kr[kk] = make_uint2(0, 0);
    if (n0 + key0 + k0 + kk < end) kr[kk] = __ldcg((const uint2*)(A.k_cache + rows[key0 + k0 + kk]) + lane);
  }
#pragma unroll
  for (int kk = 0; kk < ATT_KB; ++kk) {
    const float2 k01 = __half22float2(*(const __half2*)&kr[kk].x), k23 = __half22float2(*(const __half2*)&kr[kk].y);
    float s[ATT_G];
#pragma unroll
    for (int g = 0; g < ATT_G; ++g) {
      s[g] = qv[g][0] * k01.x + qv[g][1] * k01.y + qv[g][2] * k23.x + qv[g][3] * k23.y;
      for (int o = 16; o; o >>= 1) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
    }
    if (lane < ATT_G) {
      const float v = lane == 0 ? s[0] : lane == 1 ? s[1] : lane == 2 ? s[2] : s[3];
      sc[lane * ATT_TK + key0 + k0 + kk] = n0 + key0 + k0 + kk < end ? v * A.qk_scale : -INFINITY;
    }
  }
  }
}

// The online softmax's step for the tile (warp g < ATT_G: query head g): m, l, alpha updated and
// sc[g][*] replaced by p = 2^(s - m_new).
__device__ inline void att_softmax(float* sc, float* m, float* l, float* alpha) {
  const int lane = threadIdx.x % 32, g = threadIdx.x / 32;
  if (g >= ATT_G) return;
  float s[ATT_TK / 32], tmax = -INFINITY;
#pragma unroll
  for (int j = 0; j < ATT_TK / 32; ++j) { s[j] = sc[g * ATT_TK + lane + 32 * j]; tmax = fmaxf(tmax, s[j]); }
  for (int o = 16; o; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
  const float m_old = m[g], m_new = fmaxf(m_old, tmax);  // finite: every tile holds a key
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < ATT_TK / 32; ++j) {
    const float p = ex2(s[j] - m_new);
    sc[g * ATT_TK + lane + 32 * j] = p;
    sum += p;
  }
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) {
    const float a = ex2(m_old - m_new);  // 0 for the first tile (m_old = -inf)
    alpha[g] = a;
    l[g] = l[g] * a + sum;
    m[g] = m_new;
  }
}

// The tile's P V: thread t takes dims 2 (t % 64) and + 1 over keys 32 (t / 64) .. + 31 (all 32 loads in
// flight first) for the 4 query heads, p rounded to fp16 as the PV mma's operand; the four key
// quarters' sums go to red, then each thread folds its 2 of the 512 outputs into acc (acc alpha +
// sum), in a fixed order.
__device__ inline void att_pv(const Attn& A, int n0, int end, const float* sc, const long long* rows,
                              const float* alpha, float* red, float* acc) {
  const int t = threadIdx.x, dp = t % 64, kq = t / 64;
  float o[ATT_G][2] = {};
#pragma unroll
  for (int j0 = 0; j0 < 32; j0 += ATT_VB) {  // batches of ATT_VB values in flight
    __half2 vr[ATT_VB];
#pragma unroll
    for (int j = 0; j < ATT_VB; ++j) {
      const int key = 32 * kq + j0 + j, p = n0 + key;
      vr[j] = __float2half2_rn(0.f);
      if (p < end) vr[j] = __ldcg((const __half2*)(A.v_cache + rows[key]) + dp);
    }
#pragma unroll
    for (int j = 0; j < ATT_VB; ++j) {
      const float2 v = __half22float2(vr[j]);
#pragma unroll
      for (int g = 0; g < ATT_G; ++g) {
        const float p = __half2float(__float2half_rn(sc[g * ATT_TK + 32 * kq + j0 + j]));
        o[g][0] += p * v.x;
        o[g][1] += p * v.y;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < ATT_G; ++g) {
    red[kq * ATT_G * ATT_D + g * ATT_D + 2 * dp] = o[g][0];
    red[kq * ATT_G * ATT_D + g * ATT_D + 2 * dp + 1] = o[g][1];
  }
  consumer_sync();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int i = 2 * t + e, g = i / ATT_D;
    const float sum = red[i] + red[ATT_G * ATT_D + i] + red[2 * ATT_G * ATT_D + i] + red[3 * ATT_G * ATT_D + i];
    acc[i] = acc[i] * alpha[g] + sum;
  }
}

// The kv head's merge (decode_attention._merge_chunks): thread t's outputs 2t, 2t + 1 (one query
// head's dims d, d + 1).
__device__ inline void att_merge(const Attn& A, int head, int n_chunks) {
  const int i = 2 * threadIdx.x, g = i / ATT_D, d = i % ATT_D;
  const float* base = A.part + ((size_t)head * A.splits * ATT_G + g) * (ATT_D + 1);
  const int stride_c = ATT_G * (ATT_D + 1);
  float m = -INFINITY;
#pragma unroll 1
  for (int c = 0; c < n_chunks; ++c) m = fmaxf(m, __ldcg(base + c * stride_c + ATT_D));
  if (m == -INFINITY) m = 0.f;
  float den = 0.f, acc0 = 0.f, acc1 = 0.f;
#pragma unroll 1
  for (int c = 0; c < n_chunks; ++c) den += ex2(__ldcg(base + c * stride_c + ATT_D) - m);
#pragma unroll 1
  for (int c = 0; c < n_chunks; ++c) {
    const float w = ex2(__ldcg(base + c * stride_c + ATT_D) - m);
    acc0 += __ldcg(base + c * stride_c + d) * w;
    acc1 += __ldcg(base + c * stride_c + d + 1) * w;
  }
  den = den == 0.f ? 1.f : den;
  A.out[(head * ATT_G + g) * ATT_D + d] = __float2half_rn(acc0 / den);
  A.out[(head * ATT_G + g) * ATT_D + d + 1] = __float2half_rn(acc1 / den);
}

// Work item (head, chunk c) of n_chunks over keys [start, end). Returns whether this block stored
// the head's outputs (its last chunk to finish, or the only one): the caller then counts the head.
__device__ __forceinline__ bool att_item(const Attn& A, int head, int c, int n_chunks, int start, int end, float* smem) {
  float* qf = smem;                          // [G][D]
  float* sc = qf + ATT_G * ATT_D;            // [G][TK]
  float* acc = sc + ATT_G * ATT_TK;          // [G * D]
  float* red = acc + ATT_G * ATT_D;          // [4][G * D]
  long long* rows = (long long*)(red + 4 * ATT_G * ATT_D);  // [TK] (8-byte aligned: the offsets above are)
  float* m = (float*)(rows + ATT_TK);        // [G]
  float* l = m + ATT_G;                      // [G]
  float* alpha = l + ATT_G;                  // [G]
  int* flag = (int*)(alpha + ATT_G);
  const int t = threadIdx.x;
  if (t < ATT_D) {
#pragma unroll
    for (int g = 0; g < ATT_G; ++g) qf[g * ATT_D + t] = __half2float(__ldcg(A.q + (head * ATT_G + g) * ATT_D + t));
  }
  acc[2 * t] = acc[2 * t + 1] = 0.f;
  if (t < ATT_G) { m[t] = -INFINITY; l[t] = 0.f; }
  consumer_sync();
  for (int n0 = start; n0 < end; n0 += ATT_TK) {
    att_scores(A, head, n0, end, qf, sc, rows);
    consumer_sync();
    att_softmax(sc, m, l, alpha);
    consumer_sync();
    att_pv(A, n0, end, sc, rows, alpha, red, acc);
    consumer_sync();  // (acc and red complete; sc and rows free for the next tile)
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {  // normalized outputs 2t, 2t + 1
    const int i = 2 * t + e, g = i / ATT_D;
    const float o = acc[i] / (l[g] == 0.f ? 1.f : l[g]);
    if (n_chunks == 1) {
      A.out[head * ATT_G * ATT_D + i] = __float2half_rn(o);
    } else {
      float* p = A.part + (((size_t)head * A.splits + c) * ATT_G + g) * (ATT_D + 1);
      p[i % ATT_D] = o;
      if (i % ATT_D == 0) p[ATT_D] = l[g] == 0.f ? -INFINITY : m[g] + lg2(l[g]);
    }
  }
  if (n_chunks == 1) return true;
  __threadfence();
  consumer_sync();
  if (t == 0) *flag = atomicAdd(A.head_counts + head, 1) == n_chunks - 1;
  consumer_sync();
  const bool last = *flag;
  if (last) {
    __threadfence();  // (acquire: every chunk's partials, read through L2)
    att_merge(A, head, n_chunks);
    if (t == 0) A.head_counts[head] = 0;  // every chunk has counted: 0 for the next launch
  }
  consumer_sync();  // (smem free for the next item)
  return last;
}
