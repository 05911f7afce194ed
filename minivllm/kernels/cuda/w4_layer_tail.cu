// A decoder layer's tail for one token in ONE persistent launch (batch-1 decode, W4A16, Hopper):
//
//   o   = attn @ Wo^T                       stage 0: input `attn` [k0] fp16
//   s   = o + residual  (-> residual_out)   stage 1 input: RMSNorm(s) * w, as the engine's
//   h   = RMSNorm(s) * w                      fused_add_rms_norm rounds it
//   a   = silu(h @ Wg^T) * (h @ Wu^T)       stage 1: gate and up rows paired in each tile
//   out = a @ Wd^T                          stage 2: input a [I] fp16
//   qkv = RMSNorm(out + s) * w' @ Wqkv'^T   stage 3 (optional): the NEXT layer's input norm and
//                                           qkv projection (-> residual_out of that norm too), and
//                                           with Rope::rotate that layer's rotary on q and k and its
//                                           K/V store into the cache (OUT_QKV)
//
// It replaces five launches (o GEMV, add + norm, gate_up GEMV, SiLU-and-mul, down GEMV) by one (with
// stage 3 also the next layer's norm and qkv GEMV), and streams the weights (the tile format of
// w4_tile.cuh, written by quant/w4_tiles.py) with bulk copies into a shared-memory ring that runs
// ahead of the dependency waits between the stages: weights do not depend on activations. Measured
// design: scripts/persistent_gemv/chain.cu (its v2) and docs/perf.md (2026-11-29).
//
// Block layout: warp 8 (the producer) issues one bulk copy a tile into a ring of D slots (full and
// empty mbarriers); warps 0-7 do the math. Every block takes a contiguous range of each stage's
// row tiles (16 output rows) and runs all of a row tile's k chunks itself, so its rows are complete
// in the block: the 8 warps' partial sums are added through shared memory in a fixed order and the
// row is stored once. No atomics on data: the result has the same bits on every run.
//
// Dependencies: stage s's math starts once every block that holds row tiles of stage s - 1 has
// counted itself done (counters[s - 1], release/acquire at GPU scope). The last block to leave
// resets the counters to 0, so the next launch (stream order) finds them zeroed.
//
// Every block must be resident at once (the waits spin): the host launches occupancy x SMs blocks,
// as a cooperative grid unless told not to (then another persistent grid cannot leave it half
// resident). Shapes: every k a multiple of 2,048 up to 16,384, group size 128, fp16 activations
// and scales.
//
// PDL (programmatic dependent launch, kernels/pdl.py's contract): launched with it, the kernel may
// start while the previous one (attention) runs. The producer streams weights at once (no kernel
// writes them); the math warps wait (griddepcontrol.wait) before their first read of another
// kernel's output or the counters, then let the next kernel be scheduled. Every block is resident
// before any dependent can start (it starts only once every block has signalled).
#include "w4_tile.cuh"

using namespace w4tile;

namespace {

constexpr int CONSUMERS = MATH_THREADS;     // 8 math warps
constexpr int THREADS = CONSUMERS + 32;     // + the producer warp
#ifndef W4LT_SLOTS
#define W4LT_SLOTS 3
#endif
constexpr int D = W4LT_SLOTS;               // ring slots: 3 measured faster than 4 (docs/perf.md, leases 70-71)
constexpr int MAX_STAGES = 4;

enum InKind { IN_PLAIN = 0, IN_ADD_NORM = 1 };
enum OutKind { OUT_STORE = 0, OUT_SWIGLU = 1, OUT_QKV = 2 };

struct Stage {
  const uint4* tiles;   // rowtiles x kchunks tiles, tile (rt, kc) at rt * kchunks + kc
  const __half* in0;    // [k] input (IN_ADD_NORM: the addend, o)
  const __half* in1;    // IN_ADD_NORM: [k] residual
  const __half* norm_w; // IN_ADD_NORM: [k] RMSNorm weight
  __half* res_out;      // IN_ADD_NORM: [k] in0 + in1, written by the grid's last block
  __half* out;          // OUT_STORE: [16 rowtiles]; OUT_SWIGLU: [8 rowtiles] (rows 0-7 gate, 8-15 up);
                        // OUT_QKV: [16 rowtiles] in the natural row order (below)
  int k, rowtiles, kchunks, in_kind, out_kind;
};
// OUT_QKV: the qkv rows of heads of head_dim D, tiled in quant/w4_tiles.rope_row_order: tile rt holds
// rows 8j .. 8j + 7 of head rt / (D / 16) (j = rt % (D / 16)) and, as rows 8-15, the same rows + D / 2,
// the pairs the rotary (neox halves) mixes. With `rotate`: q (heads < q_heads) is stored rotated, k
// and v (the next kv_heads, and the kv_heads after them) unrotated as the rotary kernels leave qkv,
// and the rotated k and v go into the cache slot of the token: what the engine's rotary_store_kv
// does, with the same float32 operations (kernels/store_kv.py), so the same bits.
struct Rope {
  const long long* positions;  // [1] the token's position
  const float* cos_sin;        // [max_pos, cs_stride] float32: cos (D / 2) | sin (D / 2)
  const long long* slots;      // [1] the token's cache slot; < 0 stores nothing
  __half* k_cache;             // [blocks, block_size, kv_heads, D], v_cache with the same strides
  __half* v_cache;
  long long stride_block, stride_slot, stride_head;  // elements
  int cs_stride, block_size, q_heads, kv_heads, head_dim, rotate;
};
struct Args {
  Stage st[MAX_STAGES];
  Rope rope;  // OUT_QKV's
  int* counters;  // [MAX_STAGES + 1], 0 on entry and on exit
  float eps;
  int nstages, pdl;
};

#ifdef W4LT_PROFILE
// scripts/persistent_gemv/profile_tail.py's build: thread 0 of each block stamps %globaltimer (ns)
// at kernel entry, at each stage's start, after its wait, after its input load and after its last
// row tile, and at exit: g_prof[((launch % 64) * grid + block) * (2 + 4 MAX_STAGES) + ...], launch
// counted by g_launch (the last block out adds one). Not in the engine's build.
__device__ long long* g_prof;
__device__ int g_launch;
__device__ inline void stamp(int slot) {
  __shared__ int launch;  // read once, at entry (slot 0): later stamps add no global load to the intervals
  if (threadIdx.x == 0 && g_prof) {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (slot == 0) launch = *(volatile int*)&g_launch % 64;
    g_prof[((size_t)launch * gridDim.x + blockIdx.x) * (2 + 4 * MAX_STAGES) + slot] = t;
  }
}
#else
__device__ inline void stamp(int) {}
#endif

__device__ inline void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory"); }

// Block b's row tiles of a stage: [lo, hi). Exactly min(G, rowtiles) blocks get a non-empty range,
// and the last block always does.
__device__ inline void rowtile_range(const Stage& S, int b, int G, int& lo, int& hi) {
  lo = (int)((long long)b * S.rowtiles / G);
  hi = (int)((long long)(b + 1) * S.rowtiles / G);
}

// The sum of v over the 8 math warps (each gets the total); scratch: 8 floats, free again on return.
__device__ inline float consumers_sum(float v, float* scratch) {
  const float total = block_sum(v, scratch, CONSUMERS, consumer_sync);
  consumer_sync();  // scratch may be reused
  return total;
}

// Stores this thread's uint4s of the stage input (uint4 i = tid + 256 j: 8 values) into xs and
// each 128-group's sum into gsum: a group's 16 uint4s sit in 16 consecutive threads, so the sum is
// four shuffles inside half a warp (no pass over shared memory).
// (v holds uint4s j0 .. j0 + B - 1 of the thread's J.)
template <int B>
__device__ inline void store_input(const uint4* v, __half* xs, float* gsum, int j0, int J) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int jj = 0; jj < B; ++jj) {
    const int j = j0 + jj;
    if (j >= J) break;
    ((uint4*)xs)[tid + CONSUMERS * j] = v[jj];
    const __half2* h = (const __half2*)&v[jj];
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) { const float2 f = __half22float2(h[e]); sum += f.x + f.y; }
    for (int o = 8; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if ((tid & 15) == 0) gsum[tid / 16 + (CONSUMERS / 16) * j] = sum;
  }
}

// Stage s's input (k = 2048 J values) into xs and its group sums into gsum, once the previous
// stage's rows are all stored. The loads go in batches (all of a batch issued before the first is
// used; batches of 4 uint4s a thread, 2 for the norm: the register budget is 96 a thread).
// IN_ADD_NORM: s = fp16(in0 + in1) (written to res_out by `writer`), then
// fp16(fp16(s * rsqrt(mean(s^2) + eps)) * w), the engine's fused_add_rms_norm value for value; for
// k <= 4,096 its weights are read before the wait (no kernel writes them).
template <int J>
__device__ void wait_and_load_input(const Stage& S, int s, const int* counter, int wait_target, float eps,
                                    bool writer, __half* xs, float* gsum, float* scratch) {
  const int tid = threadIdx.x;
  constexpr bool PRELOAD = J <= 2;
  uint4 w[PRELOAD ? J : 1];
  if (PRELOAD && S.in_kind == IN_ADD_NORM) {
#pragma unroll
    for (int j = 0; j < (PRELOAD ? J : 1); ++j) w[j] = __ldg((const uint4*)S.norm_w + tid + CONSUMERS * j);
  }
#ifndef W4LT_NO_WAIT  // (profiling only: the math on whatever inputs are there, the waits' cost)
  if (wait_target > 0 && tid == 0) {  // every row of the previous stage is stored
    while (load_acquire(counter) < wait_target) __nanosleep(32);
  }
#endif
  consumer_sync();
  stamp(3 + 4 * s);
  if (S.in_kind == IN_PLAIN) {
#pragma unroll
    for (int j0 = 0; j0 < J; j0 += 4) {
      constexpr int B = J < 4 ? J : 4;
      uint4 v[B];
#pragma unroll
      for (int j = 0; j < B; ++j)
        if (j0 + j < J) v[j] = __ldcg((const uint4*)S.in0 + tid + CONSUMERS * (j0 + j));
      store_input<B>(v, xs, gsum, j0, J);
    }
    consumer_sync();
    return;
  }
  constexpr int B = J < 2 ? J : 2;
  float ss = 0.f;
#pragma unroll
  for (int j0 = 0; j0 < J; j0 += B) {  // s = fp16(in0 + in1) into xs (each thread its own uint4s)
    uint4 a[B], b[B];
#pragma unroll
    for (int j = 0; j < B; ++j) {
      if (j0 + j >= J) break;
      a[j] = __ldcg((const uint4*)S.in0 + tid + CONSUMERS * (j0 + j));
      b[j] = __ldcg((const uint4*)S.in1 + tid + CONSUMERS * (j0 + j));
    }
#pragma unroll
    for (int j = 0; j < B; ++j) {
      if (j0 + j >= J) break;
      __half2* ah = (__half2*)&a[j];
      const __half2* bh = (const __half2*)&b[j];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 fa = __half22float2(ah[e]), fb = __half22float2(bh[e]);
        ah[e] = __floats2half2_rn(fa.x + fb.x, fa.y + fb.y);
        const float2 fs = __half22float2(ah[e]);
        ss += fs.x * fs.x + fs.y * fs.y;
      }
      ((uint4*)xs)[tid + CONSUMERS * (j0 + j)] = a[j];
      if (writer) ((uint4*)S.res_out)[tid + CONSUMERS * (j0 + j)] = a[j];
    }
  }
  const float rstd = rsqrtf(consumers_sum(ss, scratch) / S.k + eps);
#pragma unroll
  for (int j0 = 0; j0 < J; j0 += B) {  // the normed values over s, and the group sums
    uint4 v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) {
      if (j0 + j >= J) break;
      v[j] = ((const uint4*)xs)[tid + CONSUMERS * (j0 + j)];
      const uint4 wj = PRELOAD ? w[(j0 + j) % (PRELOAD ? J : 1)] : __ldg((const uint4*)S.norm_w + tid + CONSUMERS * (j0 + j));
      __half2* sh = (__half2*)&v[j];
      const __half2* wh = (const __half2*)&wj;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 fs = __half22float2(sh[e]);
        const float2 y = __half22float2(__floats2half2_rn(fs.x * rstd, fs.y * rstd));  // HF: cast before the weight
        const float2 fw = __half22float2(wh[e]);
        sh[e] = __floats2half2_rn(y.x * fw.x, y.y * fw.y);
      }
    }
    store_input<B>(v, xs, gsum, j0, J);
  }
  consumer_sync();
}

// wait_and_load_input for this stage's k (a multiple of 2,048, at most 8 x 2,048).
__device__ void stage_input(const Args& args, int s, bool writer, __half* xs, float* gsum, float* scratch) {
  const Stage& S = args.st[s];
  const int* counter = args.counters + (s > 0 ? s - 1 : 0);
  const int target = s > 0 ? min((int)gridDim.x, args.st[s - 1].rowtiles) : 0;
  const float eps = args.eps;
  switch (S.k / KCHUNK) {
    case 1: wait_and_load_input<1>(S, s, counter, target, eps, writer, xs, gsum, scratch); break;
    case 2: wait_and_load_input<2>(S, s, counter, target, eps, writer, xs, gsum, scratch); break;
    case 3: wait_and_load_input<3>(S, s, counter, target, eps, writer, xs, gsum, scratch); break;
    case 4: wait_and_load_input<4>(S, s, counter, target, eps, writer, xs, gsum, scratch); break;
    case 5: wait_and_load_input<5>(S, s, counter, target, eps, writer, xs, gsum, scratch); break;
    case 6: wait_and_load_input<6>(S, s, counter, target, eps, writer, xs, gsum, scratch); break;
    case 7: wait_and_load_input<7>(S, s, counter, target, eps, writer, xs, gsum, scratch); break;
    default: wait_and_load_input<8>(S, s, counter, target, eps, writer, xs, gsum, scratch); break;
  }
}

// OUT_QKV's row pair (d, d + D / 2) of head `head` (x1, x2 rounded to fp16 as qkv stores them).
__device__ inline void store_qkv_pair(const Stage& S, const Rope& R, int head, int d, __half x1, __half x2) {
  const int half = R.head_dim / 2;
  const size_t r1 = (size_t)head * R.head_dim + d;
  const bool q = head < R.q_heads, k = !q && head < R.q_heads + R.kv_heads;
  if (!R.rotate) {
    S.out[r1] = x1;
    S.out[r1 + half] = x2;
    return;
  }
  __half o1 = x1, o2 = x2;  // v: as it is
  if (head < R.q_heads + R.kv_heads) {  // rotated, as rotated_heads: fma(c, x1, -(s x2)), fma(s, x1, c x2)
    const float* cs = R.cos_sin + *R.positions * R.cs_stride;
    const float c = cs[d], sn = cs[half + d], f1 = __half2float(x1), f2 = __half2float(x2);
    o1 = __float2half_rn(__fmaf_rn(c, f1, -__fmul_rn(sn, f2)));
    o2 = __float2half_rn(__fmaf_rn(sn, f1, __fmul_rn(c, f2)));
  }
  S.out[r1] = q ? o1 : x1;  // k and v stay unrotated in qkv
  S.out[r1 + half] = q ? o2 : x2;
  const long long slot = *R.slots;
  if (q || slot < 0) return;
  const int kv_head = k ? head - R.q_heads : head - R.q_heads - R.kv_heads;
  __half* cache = k ? R.k_cache : R.v_cache;
  const size_t at = (size_t)(slot / R.block_size) * R.stride_block + (size_t)(slot % R.block_size) * R.stride_slot +
                    (size_t)kv_head * R.stride_head + d;
  cache[at] = o1;
  cache[at + half] = o2;
}

// A finished row tile: red holds the 8 warps' partial sums of its 16 rows ([warp][row]).
__device__ inline void store_rowtile(const Stage& S, const Rope& R, int rt, const float* red) {
  const int tid = threadIdx.x;
  if (S.out_kind == OUT_QKV) {
    if (tid < ROWS / 2) {  // rows tid (first half of the head) and tid + 8 (second half)
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int w = 0; w < CONSUMERS / 32; ++w) { a += red[w * ROWS + tid]; b += red[w * ROWS + tid + 8]; }
      const int per_head = R.head_dim / ROWS;
      store_qkv_pair(S, R, rt / per_head, (rt % per_head) * (ROWS / 2) + tid, __float2half_rn(a), __float2half_rn(b));
    }
  } else if (S.out_kind == OUT_STORE) {
    if (tid < ROWS) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < CONSUMERS / 32; ++w) v += red[w * ROWS + tid];
      S.out[rt * ROWS + tid] = __float2half_rn(v);
    }
  } else if (tid < ROWS / 2) {  // rows tid (gate) and tid + 8 (up), each rounded to fp16 first
    float g = 0.f, u = 0.f;
#pragma unroll
    for (int w = 0; w < CONSUMERS / 32; ++w) { g += red[w * ROWS + tid]; u += red[w * ROWS + tid + 8]; }
    const float gf = __half2float(__float2half_rn(g)), uf = __half2float(__float2half_rn(u));
    const float act = __half2float(__float2half_rn(gf / (1.f + expf(-gf))));  // torch's silu, rounded
    S.out[rt * (ROWS / 2) + tid] = __float2half_rn(act * uf);
  }
}

__global__ void __launch_bounds__(THREADS, 2) w4_layer_tail_kernel(const __grid_constant__ Args args) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  int kmax = 0;
  for (int s = 0; s < args.nstages; ++s) kmax = max(kmax, args.st[s].k);
  __half* xs = (__half*)(ring + D * TILE_BYTES);
  float* gsum = (float*)(xs + kmax);
  float* red = gsum + kmax / GROUP;
  float* scratch = red + (CONSUMERS / 32) * ROWS;
  uint64_t* full = (uint64_t*)(scratch + 32);
  uint64_t* empty = full + D;
  const int G = gridDim.x, tid = threadIdx.x, warp = tid / 32;
  if (tid == 0) {
    for (int i = 0; i < D; ++i) { mbar_init(full + i, 1); mbar_init(empty + i, CONSUMERS / 32); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == CONSUMERS / 32) {  // the producer: every tile of this block, in the order the math takes them
    if (tid % 32 == 0) {
      int i = 0;
      for (int s = 0; s < args.nstages; ++s) {
        const Stage& S = args.st[s];
        int lo, hi; rowtile_range(S, blockIdx.x, G, lo, hi);
        for (int t = lo * S.kchunks; t < hi * S.kchunks; ++t, ++i) {
          const int slot = i % D;
          if (i >= D) mbar_wait_sleep(empty + slot, (i / D - 1) & 1);
          bulk_load(ring + slot * TILE_BYTES, S.tiles + (size_t)t * (TILE_BYTES / 16), TILE_BYTES, full + slot);
        }
      }
    }
    return;
  }

  stamp(0);
  if (args.pdl) {  // the previous kernels' outputs (and the counters' reset) are visible after this
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (tid == 0) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
  int i = 0;
  uint32_t xr[32];
  for (int s = 0; s < args.nstages; ++s) {
    const Stage& S = args.st[s];
    int lo, hi; rowtile_range(S, blockIdx.x, G, lo, hi);
    if (lo == hi) continue;
    stamp(2 + 4 * s);
    stage_input(args, s, blockIdx.x == G - 1, xs, gsum, scratch);
    stamp(4 + 4 * s);
    for (int rt = lo; rt < hi; ++rt) {
      float acc_a = 0.f, acc_b = 0.f;  // rows lane / 4 and + 8, this warp's k
      for (int kc = 0; kc < S.kchunks; ++kc, ++i) {
        load_xr(xs + kc * KCHUNK, xr);
        const int slot = i % D;
        mbar_wait_sleep(full + slot, (i / D) & 1);
        float a = 0.f, b = 0.f;
#ifndef W4LT_NO_MATH  // (profiling only: the tiles consumed unread, the math's cost)
        tile_dot<true>(ring + slot * TILE_BYTES, xr, gsum + kc * GROUPS, a, b);
#endif
        acc_a += a; acc_b += b;
        __syncwarp();
        if (tid % 32 == 0) mbar_arrive(empty + slot);
      }
      const int lane = tid % 32;
      if (lane % 4 == 0) { red[warp * ROWS + lane / 4] = acc_a; red[warp * ROWS + lane / 4 + 8] = acc_b; }
      consumer_sync();
      store_rowtile(S, args.rope, rt, red);
      consumer_sync();  // red is free again
    }
    if (tid == 0) {  // the stores above (threads < 16) are ordered before the count by the barrier + fence
      __threadfence();
      atomicAdd(args.counters + s, 1);
    }
    stamp(5 + 4 * s);
  }
  stamp(1);
  // leave: the last block out resets the counters (every wait is over by then)
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(args.counters + MAX_STAGES, 1) == G - 1) {
      for (int s = 0; s <= MAX_STAGES; ++s) args.counters[s] = 0;
#ifdef W4LT_PROFILE
      ++g_launch;
#endif
      __threadfence();
    }
  }
}

}  // namespace

// ---- host side (ctypes: minivllm/kernels/w4_layer_tail.py) ----------------------------------
extern "C" {

// The launch's dynamic shared memory for the widest stage input kmax.
int w4lt_smem_bytes(int kmax) {
  return D * TILE_BYTES + kmax * 2 + (kmax / GROUP) * 4 + (CONSUMERS / 32) * ROWS * 4 + 32 * 4 + 2 * D * 8;
}

// Raises the kernel's shared-memory limit on `device` to what kmax needs (never lowers it: another
// model of the process may launch with a wider input) and returns the blocks that fit the device at
// once (occupancy x SMs; 0 when not even one fits), or -1 with a CUDA error.
int w4lt_grid(int device, int kmax) {
  static int smem_limit[64] = {};  // per device: the limit set so far
  const int smem = w4lt_smem_bytes(kmax);
  if (device < 0 || device >= 64 || cudaSetDevice(device) != cudaSuccess) return -1;
  if (smem > smem_limit[device]) {
    if (cudaFuncSetAttribute(w4_layer_tail_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      return -1;
    smem_limit[device] = smem;
  }
  int per_sm = 0, sms = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, w4_layer_tail_kernel, THREADS, smem) != cudaSuccess)
    return -1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return -1;
  return per_sm * sms;
}

// The host-side mirror of a Stage, flat for ctypes: 6 pointers, then 5 ints.
struct FlatStage {
  const void *tiles, *in0, *in1, *norm_w;
  void *res_out, *out;
  int k, rowtiles, kchunks, in_kind, out_kind;
};
// The host-side mirror of Rope: 5 pointers, 3 int64 strides, 6 ints.
struct FlatRope {
  const void *positions, *cos_sin, *slots;
  void *k_cache, *v_cache;
  long long stride_block, stride_slot, stride_head;
  int cs_stride, block_size, q_heads, kv_heads, head_dim, rotate;
};

// Launches `nstages` stages on `stream` (captured into a CUDA graph when the stream is capturing),
// with PDL if `pdl`, as a cooperative launch if `coop`; `rope`: OUT_QKV's (NULL when no stage has
// it). Returns the launch's cudaError_t.
int w4lt_launch(const FlatStage* stages, int nstages, const FlatRope* rope, int* counters, float eps, int grid,
                int kmax, int pdl, int coop, void* stream) {
  if (nstages < 1 || nstages > MAX_STAGES) return (int)cudaErrorInvalidValue;
  Args a = {};
  if (rope) {
    if (rope->head_dim % ROWS != 0) return (int)cudaErrorInvalidValue;  // whole row pairs in a tile
    a.rope = Rope{(const long long*)rope->positions, (const float*)rope->cos_sin, (const long long*)rope->slots,
                  (__half*)rope->k_cache, (__half*)rope->v_cache, rope->stride_block, rope->stride_slot,
                  rope->stride_head, rope->cs_stride, rope->block_size, rope->q_heads, rope->kv_heads,
                  rope->head_dim, rope->rotate};
  }
  for (int s = 0; s < nstages; ++s) {
    const FlatStage& f = stages[s];
    a.st[s] = Stage{(const uint4*)f.tiles, (const __half*)f.in0, (const __half*)f.in1, (const __half*)f.norm_w,
                    (__half*)f.res_out, (__half*)f.out, f.k, f.rowtiles, f.kchunks, f.in_kind, f.out_kind};
    if (f.out_kind == OUT_QKV && !rope) return (int)cudaErrorInvalidValue;
  }
  a.counters = counters;
  a.eps = eps;
  a.nstages = nstages;
  a.pdl = pdl;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = w4lt_smem_bytes(kmax);
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (coop) {  // the hardware starts the grid only when every block can be resident (the waits spin)
    attr[n].id = cudaLaunchAttributeCooperative;
    attr[n++].val.cooperative = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return (int)cudaLaunchKernelEx(&cfg, w4_layer_tail_kernel, a);
}

const char* w4lt_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

#ifdef W4LT_PROFILE
// Points the stamps at buf and restarts the launch count: the next launch writes slot 0.
int w4lt_set_profile(long long* buf) {
  const int zero = 0;
  cudaError_t e = cudaMemcpyToSymbol(g_prof, &buf, sizeof(buf));
  return (int)(e != cudaSuccess ? e : cudaMemcpyToSymbol(g_launch, &zero, sizeof(zero)));
}
#endif

}  // extern "C"
