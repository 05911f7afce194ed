// A token's 128 W4A16 GEMVs of Llama-3.1-8B (32 layers x qkv, o, gate_up, down) in ONE persistent
// launch: the feasibility probe for issue 25's decode megakernel. Not used by the engine.
//
// Question it answers: without kernel boundaries, and with each SM's weight loads running ahead of
// the dependency waits, how close do the GEMVs come to the H200's copy rate? Lease 46's Triton
// chain (grid barriers, loads issued only after each barrier) was 3x SLOWER than separate launches;
// the difference here is the decoupling: weights do not depend on activations, so every block
// keeps D tiles of bulk copies in flight into a shared-memory ring across stage boundaries, and
// only the math waits for the previous stage.
//
// Layout (ours, a load-time repack of AWQ's): a tile is 16 output rows x 2,048 k of int4 in the
// order the tensor cores' m16n8k16 A fragment wants ([8 warps][16 k steps][32 lanes] words), then
// [16 rows][16 groups] half2 {scale, 1024 + zero}: 17,408 bytes. Warp w owns k [256w, 256w + 256)
// of the tile; the product runs on mma.sync with x broadcast into every B column.
//
// Dataflow: stage s (a GEMV of one layer) may run its math once every block that holds a tile of
// stage s - 1 has counted itself done. The residual stream h (fp32) takes o's and down's products
// by atomics; qkv and gate_up read RMS-normalised h; down reads silu(gate) * up; o reads q (the
// first 4,096 outputs of qkv: attention is not modelled). RMSNorm gains are 1.
//
// The designs, each checked against the per-stage reference at the end of the file (figures:
// docs/perf.md, 2026-11-29): v1, one block-wide loop (its MODEs give the read-only and ring-only
// bounds); v2, a producer warp and 8 math warps on full/empty mbarriers (the fastest); v3, v2 with
// each stage's tail claimed at run time; v4, chunk-level dataflow (each tile waits only for the
// input chunk it reads).
//
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o chain chain.cu
// Run:   ./chain [layers=32] [iterations=20]   (or the gpu_multi.sh step persistent-chain)
#include <cuda_fp16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
#include "../../minivllm/kernels/cuda/w4_tile.cuh"

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

// the tile format, the PTX helpers and the tile math live in the engine's header (w4_tile.cuh)
using namespace w4tile;
constexpr int THREADS = MATH_THREADS;  // 8 warps, each 256 k of the tile
constexpr int MAX_STAGES = 4 * 32 + 1;

enum InKind { IN_PLAIN = 0, IN_RMSNORM = 1, IN_SWIGLU = 2 };

struct Stage {
  const uint4* tiles;  // ntiles * TILE_BYTES, tile t = (kc = t / rowtiles, rt = t % rowtiles)
  const float* in;     // input vector, fp32 (k values; 2k for swiglu: gate then up)
  float* out;          // fp32 output, accumulated by atomics (pre-zeroed, or the residual)
  int k, rows, rowtiles, kchunks, ntiles, base, in_kind, seed;
};
__constant__ Stage c_stages[MAX_STAGES];

// ---------------------------------------------------------------------------------------------
// Deterministic weights: Q in [0, 16), a scale per (row, group) ~ 1/sqrt(21.25 k), a zero in [0, 16).
__host__ __device__ inline uint32_t mix(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
  return (uint32_t)x;
}
__device__ inline uint32_t weight_q(int seed, int row, int k) {
  return mix(((uint64_t)seed << 48) ^ ((uint64_t)row << 24) ^ (uint64_t)k) & 15u;
}
__device__ inline float weight_scale(int seed, int row, int group, int k_total) {
  uint32_t h = mix(((uint64_t)(seed + 7919) << 48) ^ ((uint64_t)row << 24) ^ (uint64_t)group);
  return __half2float(__float2half((0.75f + 0.5f * (h & 1023u) / 1024.f) * rsqrtf(21.25f * k_total)));
}
__device__ inline uint32_t weight_zero(int seed, int row, int group) {
  return mix(((uint64_t)(seed + 104729) << 48) ^ ((uint64_t)row << 24) ^ (uint64_t)group) & 15u;
}

// One thread per 32-bit word of every tile of stage s (plus the tile's scale/zero words).
__global__ void fill_tiles(int s) {
  const Stage& S = c_stages[s];
  const int words_per_tile = TILE_BYTES / 4;
  int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (int64_t)S.ntiles * words_per_tile) return;
  int t = (int)(idx / words_per_tile), w = (int)(idx % words_per_tile);
  int kc = t / S.rowtiles, row0 = (t % S.rowtiles) * ROWS;
  uint32_t* dst = (uint32_t*)S.tiles + idx;
  if (w < WORD_BYTES / 4) {
    // w = (warp * 16 + step) * 32 + lane; the word holds the lane's A fragment of that k step.
    int lane = w % 32, step = (w / 32) % 16, warp = w / 512;
    int r = lane / 4, kk = kc * KCHUNK + warp * 256 + step * 16 + (lane % 4) * 2;
    int ra = row0 + r, rb = row0 + r + 8;
    uint32_t v = weight_q(S.seed, ra, kk) | weight_q(S.seed, rb, kk) << 4 |
                 weight_q(S.seed, ra, kk + 8) << 8 | weight_q(S.seed, rb, kk + 8) << 12 |
                 weight_q(S.seed, ra, kk + 1) << 16 | weight_q(S.seed, rb, kk + 1) << 20 |
                 weight_q(S.seed, ra, kk + 9) << 24 | weight_q(S.seed, rb, kk + 9) << 28;
    *dst = v;
  } else {
    int j = w - WORD_BYTES / 4, r = j / GROUPS, g = j % GROUPS, group = kc * GROUPS + g;
    __half2 sz = __halves2half2(__float2half(weight_scale(S.seed, row0 + r, group, S.k)),
                                __float2half(1024.f + weight_zero(S.seed, row0 + r, group)));
    *dst = *(uint32_t*)&sz;
  }
}

template <int N>
__device__ inline float sum_squares(const float4* a) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) acc += a[j].x * a[j].x + a[j].y * a[j].y + a[j].z * a[j].z + a[j].w * a[j].w;
  return acc;
}

__device__ inline void block_sync() { __syncthreads(); }

__device__ inline float silu(float v) { return v / (1.f + __expf(-v)); }

// The stage's whole input (k values, <= 14,336) as fp16 in shared memory, once a stage per block
// (the same rounding the reference uses). Every load of it is issued before the first use.
constexpr int XMAX = 14336;  // v1: the widest stage input
template <int N, bool SWIGLU>
__device__ inline void convert_store(const float4* a, const float4* u, float scale, int j0, int k, __half* xs) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = ((j0 + j) * THREADS + threadIdx.x) * 4;
    if (i < k) {
      float4 v = a[j];
      if (SWIGLU) {
        v.x = silu(v.x) * u[j].x; v.y = silu(v.y) * u[j].y; v.z = silu(v.z) * u[j].z; v.w = silu(v.w) * u[j].w;
      }
      __half2 h[2] = {__floats2half2_rn(v.x * scale, v.y * scale), __floats2half2_rn(v.z * scale, v.w * scale)};
      *(uint2*)(xs + i) = *(uint2*)h;
    }
  }
}
__device__ void load_stage_input(const Stage& S, __half* xs, float* scratch) {
  const int tid = threadIdx.x;
  if (S.in_kind == IN_SWIGLU) {  // 14,336 gate + up values: two batches of 7 float4 pairs a thread
    constexpr int B = 7;
    for (int j0 = 0; j0 * THREADS * 4 < S.k; j0 += B) {
      float4 a[B], u[B];
#pragma unroll
      for (int j = 0; j < B; ++j) {
        const int i = ((j0 + j) * THREADS + tid) * 4;
        if (i < S.k) { a[j] = __ldcg((const float4*)(S.in + i)); u[j] = __ldcg((const float4*)(S.in + S.k + i)); }
      }
      convert_store<B, true>(a, u, 1.f, j0, S.k, xs);
    }
  } else {  // 4,096 values: 4 float4 a thread, all in flight, then the mean of squares if normed
    constexpr int B = 4;
    float4 a[B];
#pragma unroll
    for (int j = 0; j < B; ++j) a[j] = __ldcg((const float4*)(S.in + (j * THREADS + tid) * 4));
    float scale = 1.f;
    if (S.in_kind == IN_RMSNORM) scale = rsqrtf(block_sum(sum_squares<B>(a), scratch, THREADS, block_sync) / S.k + 1e-5f);
    convert_store<B, false>(a, nullptr, scale, 0, S.k, xs);
  }
  __syncthreads();
}

// v1's tile: the warps' partial sums reduced through shared memory, one atomic a row.
// xs is the chunk's first input value.
template <bool MATH>
__device__ void compute_tile(const uint8_t* slot, const __half* xs, float* red, float* out) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, r = lane / 4, q = lane % 4;
  float acc_a = 0.f, acc_b = 0.f;  // rows r and r + 8
  if (MATH) {
    uint32_t xr[32];
    load_xr(xs, xr);
    tile_dot<false>(slot, xr, nullptr, acc_a, acc_b);
  } else {
    acc_a = (float)((const uint32_t*)slot)[warp * 512 + lane] * 0.f;  // the read alone (keeps the ring's consumer in the loop)
  }
  if (q == 0) { red[warp * ROWS + r] = acc_a; red[warp * ROWS + r + 8] = acc_b; }
  __syncthreads();
  if (tid < ROWS) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) s += red[w * ROWS + tid];
    atomicAdd(out + tid, s);
  }
}

// ---------------------------------------------------------------------------------------------
// The persistent chain. Block b takes the global tiles g = b, b + G, b + 2G, ... (stage-major), so
// every block's bytes over the whole token differ by at most one tile.
// Each tile is one bulk copy through the copy engine, completing on its slot's mbarrier.
// PROF: thread 0 of each block records, a stage, cycles spinning on the previous stage, loading the
// input, running the tiles, and waiting on the ring (prof[(block * nstages + s) * 4 + ...]).
// MODE: 0 = everything; 1 = loads and waits, no math (the read bound of this schedule); 3 = the ring
// alone (loads, no waits on other stages, no inputs, no math). (Measured and removed, in git
// history: the per-thread cp.async loader, mode 2 and per-warp atomics; docs/perf.md 2026-11-29.)
template <int D, int MODE>
__global__ void __launch_bounds__(THREADS, 1) chain_kernel(int* done, int nstages, int total, long long* prof) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  __half* xs = (__half*)(ring + D * TILE_BYTES);
  float* red = (float*)(xs + XMAX);
  float* scratch = red + (THREADS / 32) * ROWS;
  uint64_t* bars = (uint64_t*)(scratch + 32);  // one a slot
  const int G = gridDim.x, tid = threadIdx.x;
  constexpr bool MATH = MODE == 0, WAITS = MODE != 3;
  long long t_stage = 0, t_spin = 0, t_input = 0, t_ring = 0;

  if (tid == 0) {
    for (int i = 0; i < D; ++i) mbar_init(bars + i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  int load_g = blockIdx.x, load_s = 0;
  auto issue = [&](int slot) {  // the next tile of this block into `slot` (nothing past the end)
    if (load_g < total && tid == 0) {
      while (load_s + 1 < nstages && load_g >= c_stages[load_s + 1].base) ++load_s;
      const Stage& S = c_stages[load_s];
      const uint4* src = S.tiles + (size_t)(load_g - S.base) * (TILE_BYTES / 16);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the slot's reads before the copy
      bulk_load(ring + slot * TILE_BYTES, src, TILE_BYTES, bars + slot);
    }
    load_g += G;
  };
#pragma unroll
  for (int i = 0; i < D; ++i) issue(i);

  int s = 0, cur_s = -1, i = 0;
  for (int g = blockIdx.x; g < total; g += G, ++i) {
    while (s + 1 < nstages && g >= c_stages[s + 1].base) ++s;
    const Stage& S = c_stages[s];
    const int t = g - S.base, kc = t / S.rowtiles, rt = t % S.rowtiles;
    if (s != cur_s) {  // the previous stage's outputs must be complete before any math of this one
      if (prof && tid == 0) { t_stage = clock64(); t_ring = 0; }
      if (WAITS && s > 0 && tid == 0) {
        const int target = min(G, c_stages[s - 1].ntiles);
        while (load_acquire(done + s - 1) < target) {}
      }
      __syncthreads();
      if (prof && tid == 0) t_spin = clock64();
      cur_s = s;
      if (WAITS) load_stage_input(S, xs, scratch);
      if (prof && tid == 0) t_input = clock64();
    }
    long long t0 = prof && tid == 0 ? clock64() : 0;
    mbar_wait(bars + i % D, (i / D) & 1);
    if (prof && tid == 0) t_ring += clock64() - t0;
    __syncthreads();
    compute_tile<MATH>(ring + (i % D) * TILE_BYTES, xs + kc * KCHUNK, red, S.out + rt * ROWS);
    __syncthreads();  // the slot and `red` are free again
    issue(i % D);
    if (g + G >= S.base + S.ntiles && tid == 0) {  // this block's last tile of stage s
      __threadfence();
      atomicAdd(done + s, 1);
      if (prof) {
        long long* p = prof + ((size_t)blockIdx.x * nstages + s) * 4;
        p[0] = t_spin - t_stage; p[1] = t_input - t_spin; p[2] = clock64() - t_input; p[3] = t_ring;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v2: warp-specialised. Warp 8 streams every tile of this block into the ring (full/empty
// mbarriers, no block-wide barrier in the steady state); warps 0-7 do the math, each adding its own
// partial sums by atomics. A block's tiles of a stage are one contiguous range (kc-major), so the
// down stage needs one or two of its seven input chunks. The zero is folded out of the weights:
// the tensor cores multiply 1024 + n (and 1024 + 16 n) directly and each group's result is
// corrected with the group's sum of inputs, so the dequantisation is one LOP3 a register.
constexpr int CONSUMERS = THREADS;                 // 8 math warps
constexpr int THREADS2 = THREADS + 32;             // + the producer warp
__device__ inline void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory"); }
__device__ inline void tile_range(const Stage& S, int b, int G, int& lo, int& hi) {
  lo = (int)((long long)b * S.ntiles / G); hi = (int)((long long)(b + 1) * S.ntiles / G);
}
// The input values [base, base + n) (n = 4,096 or a 2,048 chunk), fp16 into xs[0..n), and each
// 128-group's sum of those fp16 values into gsum. Thread t's float4 j sits in group 8j + warp.
template <int J>
__device__ void load_input_v2(const Stage& S, int base, __half* xs, float* gsum, float* scratch) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  float4 a[J], u[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int i = (j * CONSUMERS + tid) * 4;
    a[j] = __ldcg((const float4*)(S.in + base + i));
    if (S.in_kind == IN_SWIGLU) u[j] = __ldcg((const float4*)(S.in + S.k + base + i));
  }
  float scale = 1.f;
  if (S.in_kind == IN_RMSNORM) scale = rsqrtf(block_sum(sum_squares<J>(a), scratch, CONSUMERS, consumer_sync) / S.k + 1e-5f);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    float4 v = a[j];
    if (S.in_kind == IN_SWIGLU) {
      v.x = silu(v.x) * u[j].x; v.y = silu(v.y) * u[j].y; v.z = silu(v.z) * u[j].z; v.w = silu(v.w) * u[j].w;
    }
    __half2 h[2] = {__floats2half2_rn(v.x * scale, v.y * scale), __floats2half2_rn(v.z * scale, v.w * scale)};
    *(uint2*)(xs + (j * CONSUMERS + tid) * 4) = *(uint2*)h;
    float sum = __low2float(h[0]) + __high2float(h[0]) + __low2float(h[1]) + __high2float(h[1]);
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) gsum[j * 8 + warp] = sum;
  }
  consumer_sync();
}

// v2-v4's tile: each warp adds its own partial sums by atomics.
template <bool ZFOLD>
__device__ inline void compute_tile_v2(const uint8_t* slot, const uint32_t* xr, const float* gsum, float* out) {
  float acc_a, acc_b;
  tile_dot<ZFOLD>(slot, xr, gsum, acc_a, acc_b);
  const int lane = threadIdx.x % 32, r = lane / 4;
  if (lane % 4 == 0) { atomicAdd(out + r, acc_a); atomicAdd(out + r + 8, acc_b); }
}

// The end of a block's stage s in v2 and v3: once every math warp's atomics are issued, count the
// block done (the fence orders them before the count) and keep thread 0's cycle record.
__device__ inline void stage_done(int* done, int s, int nstages, long long* prof, long long t_stage,
                                  long long t_spin, long long t_input, long long t_ring) {
  consumer_sync();
  if (threadIdx.x != 0) return;
  __threadfence();
  atomicAdd(done + s, 1);
  if (prof) {
    long long* p = prof + ((size_t)blockIdx.x * nstages + s) * 4;
    p[0] = t_spin - t_stage; p[1] = t_input - t_spin; p[2] = clock64() - t_input; p[3] = t_ring;
  }
}

// v2-v4's shared memory: the ring of D tiles, the stage input (4,096 fp16 values), its 32 group
// sums, a scratch row, then each slot's full and empty barriers (v3 puts the slots' tile numbers
// after them). Thread 0 initialises the barriers; every thread returns past a block barrier.
struct RingSmem {
  uint8_t* ring; __half* xs; float* gsum; float* scratch; uint64_t* full; uint64_t* empty;
};
template <int D>
__device__ RingSmem ring_smem_init(uint8_t* smem) {
  RingSmem m;
  m.ring = smem;
  m.xs = (__half*)(smem + D * TILE_BYTES);
  m.gsum = (float*)(m.xs + 4096);
  m.scratch = m.gsum + 32;
  m.full = (uint64_t*)(m.scratch + 32);
  m.empty = m.full + D;
  if (threadIdx.x == 0) {
    for (int i = 0; i < D; ++i) { mbar_init(m.full + i, 1); mbar_init(m.empty + i, CONSUMERS / 32); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  return m;
}

// The warp's B fragments are held in 32 registers a chunk. NOWAIT: no stage waits and no input
// loads (the math runs on whatever xs holds): the floor of this kernel's streaming and math without
// any dependency between stages. (Measured and removed, in git history: L2 prefetch ahead of the
// ring, spinning waits, 8 chains at one block an SM, B from shared memory at three; docs/perf.md.)
template <int D, int BPS, bool ZFOLD, bool NOWAIT = false>
__global__ void __launch_bounds__(THREADS2, BPS) chain_v2(int* done, int nstages, long long* prof) {
  extern __shared__ __align__(128) uint8_t smem[];
  const RingSmem m = ring_smem_init<D>(smem);
  const int G = gridDim.x, tid = threadIdx.x, warp = tid / 32;

  if (warp == CONSUMERS / 32) {  // the producer
    if (tid % 32 == 0) {
      int i = 0;
      for (int s = 0; s < nstages; ++s) {
        int lo, hi; tile_range(c_stages[s], blockIdx.x, G, lo, hi);
        for (int t = lo; t < hi; ++t, ++i) {
          const int slot = i % D;
          if (i >= D) mbar_wait_sleep(m.empty + slot, (i / D - 1) & 1);
          bulk_load(m.ring + slot * TILE_BYTES, c_stages[s].tiles + (size_t)t * (TILE_BYTES / 16), TILE_BYTES, m.full + slot);
        }
      }
    }
    return;
  }

  int i = 0;
  long long t_stage = 0, t_spin = 0, t_input = 0, t_ring = 0;
  for (int s = 0; s < nstages; ++s) {
    const Stage& S = c_stages[s];
    int lo, hi; tile_range(S, blockIdx.x, G, lo, hi);
    if (lo == hi) continue;
    if (prof && tid == 0) { t_stage = clock64(); t_ring = 0; }
    if (!NOWAIT && s > 0 && tid == 0) {
      const int target = min(G, c_stages[s - 1].ntiles);
      while (load_acquire(done + s - 1) < target) __nanosleep(32);
    }
    consumer_sync();
    if (prof && tid == 0) t_spin = clock64();
    const bool chunked = !NOWAIT && S.in_kind == IN_SWIGLU;
    int cur_kc = -1, xr_kc = -1;
    uint32_t xr[32];
    if (!chunked && !NOWAIT) load_input_v2<4>(S, 0, m.xs, m.gsum, m.scratch);
    if (prof && tid == 0) t_input = clock64();
    int kc = lo / S.rowtiles, rt = lo % S.rowtiles;
    for (int t = lo; t < hi; ++t, ++i, (++rt == S.rowtiles ? (rt = 0, ++kc) : 0)) {
      if (chunked && kc != cur_kc) {
        if (cur_kc >= 0) consumer_sync();  // every warp is done with the previous chunk
        load_input_v2<2>(S, kc * KCHUNK, m.xs, m.gsum, m.scratch);
        cur_kc = kc; xr_kc = -1;
      }
      const int xoff = chunked || NOWAIT ? 0 : kc * KCHUNK;
      if (kc != xr_kc) { load_xr(m.xs + xoff, xr); xr_kc = kc; }
      const int slot = i % D;  // D is a compile-time constant: a multiply, not a division
      long long t0 = prof && tid == 0 ? clock64() : 0;
      mbar_wait_sleep(m.full + slot, (i / D) & 1);
      if (prof && tid == 0) t_ring += clock64() - t0;
      compute_tile_v2<ZFOLD>(m.ring + slot * TILE_BYTES, xr, m.gsum + xoff / GROUP, S.out + rt * ROWS);
      __syncwarp();
      if (tid % 32 == 0) mbar_arrive(m.empty + slot);
    }
    stage_done(done, s, nstages, prof, t_stage, t_spin, t_input, t_ring);
  }
}

// ---------------------------------------------------------------------------------------------
// v3: v2 with each stage's last G tiles claimed at run time (one atomic a tile), so that the blocks
// that run fast take more of the tail and a stage ends when the GPU's work does, not when its
// slowest block's fixed share does. The producer writes each slot's tile number (or -1: this block
// has no more tiles of the stage) before the slot's barrier completes; every block signals every
// stage. claim[s] counts the claimed tail tiles of stage s.
template <int D, int BPS>
__global__ void __launch_bounds__(THREADS2, BPS) chain_v3(int* done, int nstages, long long* prof) {
  extern __shared__ __align__(128) uint8_t smem[];
  const RingSmem m = ring_smem_init<D>(smem);
  const int G = gridDim.x, tid = threadIdx.x, warp = tid / 32;
  volatile int* slot_tile = (volatile int*)(m.empty + D);
  int* claim = done + MAX_STAGES;

  if (warp == CONSUMERS / 32) {  // the producer
    if (tid % 32 == 0) {
      int i = 0;
      auto emit = [&](const Stage& S, int t) {
        const int slot = i % D;
        if (i >= D) mbar_wait_sleep(m.empty + slot, (i / D - 1) & 1);
        slot_tile[slot] = t;
        if (t >= 0) bulk_load(m.ring + slot * TILE_BYTES, S.tiles + (size_t)t * (TILE_BYTES / 16), TILE_BYTES, m.full + slot);
        else mbar_arrive(m.full + slot);
        ++i;
      };
      for (int s = 0; s < nstages; ++s) {
        const Stage& S = c_stages[s];
        const int n_static = max(0, S.ntiles - G);
        const int lo = (int)((long long)blockIdx.x * n_static / G), hi = (int)((long long)(blockIdx.x + 1) * n_static / G);
        for (int t = lo; t < hi; ++t) emit(S, t);
        for (int c = atomicAdd(claim + s, 1); n_static + c < S.ntiles; c = atomicAdd(claim + s, 1)) emit(S, n_static + c);
        emit(S, -1);
      }
    }
    return;
  }

  int i = 0;
  long long t_stage = 0, t_spin = 0, t_input = 0, t_ring = 0;
  uint32_t xr[32];
  for (int s = 0; s < nstages; ++s) {
    const Stage& S = c_stages[s];
    if (prof && tid == 0) { t_stage = clock64(); t_ring = 0; }
    if (s > 0 && tid == 0) {
      while (load_acquire(done + s - 1) < G) __nanosleep(32);
    }
    consumer_sync();
    if (prof && tid == 0) t_spin = clock64();
    const bool chunked = S.in_kind == IN_SWIGLU;
    int cur_kc = -1, xr_kc = -1;
    if (!chunked) load_input_v2<4>(S, 0, m.xs, m.gsum, m.scratch);
    if (prof && tid == 0) t_input = clock64();
    for (;; ++i) {
      const int slot = i % D;
      long long t0 = prof && tid == 0 ? clock64() : 0;
      mbar_wait_sleep(m.full + slot, (i / D) & 1);
      if (prof && tid == 0) t_ring += clock64() - t0;
      const int t = slot_tile[slot];
      if (t < 0) {
        __syncwarp();
        if (tid % 32 == 0) mbar_arrive(m.empty + slot);
        ++i;
        break;
      }
      const int kc = t / S.rowtiles, rt = t % S.rowtiles;
      if (chunked && kc != cur_kc) {
        if (cur_kc >= 0) consumer_sync();
        load_input_v2<2>(S, kc * KCHUNK, m.xs, m.gsum, m.scratch);
        cur_kc = kc; xr_kc = -1;
      }
      const int xoff = chunked ? 0 : kc * KCHUNK;
      if (kc != xr_kc) { load_xr(m.xs + xoff, xr); xr_kc = kc; }
      compute_tile_v2<true>(m.ring + slot * TILE_BYTES, xr, m.gsum + xoff / GROUP, S.out + rt * ROWS);
      __syncwarp();
      if (tid % 32 == 0) mbar_arrive(m.empty + slot);
    }
    stage_done(done, s, nstages, prof, t_stage, t_spin, t_input, t_ring);
  }
}

// ---------------------------------------------------------------------------------------------
// v4: chunk-level dataflow. A tile waits only for the 2,048-value input chunk it reads, not for
// the whole previous stage, so a stage starts while the previous one ends. Every stage's tiles are
// dealt to the blocks in turn (position p to block p mod G) in an order that finishes the next
// stage's first chunks early: k chunk major, and gate_up's output rows interleave gate and up
// chunks (g0 u0 g1 u1 ...), which down's first chunk needs.
// No buffer is written while a stage may still read it: o and down add into zeroed per-layer
// buffers O[l] and D[l]; h_l = Hm[l-1] + O[l-1] + D[l-1] is written once, chunk by chunk, into
// Hm[l] by the block that reads the chunk first for qkv ("the owner": the block of the chunk's
// first position). RMSNorm is applied where the GEMV's output is read (a scalar): the owners add
// each chunk's sum of squares into ss[l].
struct V4 {
  const float* hin;            // h_0
  float *qkv, *gu, *o, *d, *hm;  // per layer: 6,144 / 28,672 / 4,096 / 4,096 / 4,096
  int* cnt;                    // per layer V4_CNT counters (below)
  float* ss;                   // per layer: sum of squares of h_l, of h_l + o_l
};
constexpr int V4_CNT = 24;
// counters of layer l: +0 q rows chunk ready [2], +2 o [2], +4 gate_up [14], +18 down [2],
// +20 Hm chunk written [2], +22 ssQ terms [1], +23 ssG terms [1]. Tile counters count warps (8 a tile).
__device__ inline void v4_order(int kind, const Stage& S, int p, int& kc, int& rt) {
  kc = p / S.rowtiles;
  const int j = p % S.rowtiles;
  if (kind == 2) {  // gate_up: pairs (gate chunk c, up chunk c) of 128 row tiles each, in turn
    const int pair = j / 256, half = (j % 256) / 128;
    rt = half * 896 + pair * 128 + j % 128;
  } else {
    rt = j;
  }
}
__device__ inline void wait_at_least(const int* c, int target) {
  while (load_acquire(c) < target) __nanosleep(20);
}

// Chunk c (2,048 values) of a stage input: the sum of up to three fp32 vectors (or silu(s g) * s u),
// times `scale`, as fp16 into xs[0..2048) and its 16 group sums into gsum. If `hm` is given, the
// fp32 sum is written there too; with `want_sq` the chunk's sum of squares is returned to thread 0.
__device__ float v4_load_chunk(const float* a, const float* b, const float* c3, const float* up,
                               float scale, __half* xs, float* gsum, float* hm, bool want_sq, float* scratch) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  float4 v[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = (j * CONSUMERS + tid) * 4;
    v[j] = __ldcg((const float4*)(a + i));
    if (b) { float4 w = __ldcg((const float4*)(b + i)); v[j].x += w.x; v[j].y += w.y; v[j].z += w.z; v[j].w += w.w; }
    if (c3) { float4 w = __ldcg((const float4*)(c3 + i)); v[j].x += w.x; v[j].y += w.y; v[j].z += w.z; v[j].w += w.w; }
    if (up) {
      float4 u = __ldcg((const float4*)(up + i));
      v[j].x = silu(scale * v[j].x) * u.x; v[j].y = silu(scale * v[j].y) * u.y;
      v[j].z = silu(scale * v[j].z) * u.z; v[j].w = silu(scale * v[j].w) * u.w;
    }
  }
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = (j * CONSUMERS + tid) * 4;
    if (hm) *(float4*)(hm + i) = v[j];
    if (want_sq) sq += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    // times the scale: x s for a normed input; for down, silu(s g) (above) times s u
    __half2 h[2] = {__floats2half2_rn(v[j].x * scale, v[j].y * scale), __floats2half2_rn(v[j].z * scale, v[j].w * scale)};
    *(uint2*)(xs + i) = *(uint2*)h;
    float sum = __low2float(h[0]) + __high2float(h[0]) + __low2float(h[1]) + __high2float(h[1]);
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) gsum[j * 8 + warp] = sum;
  }
  if (want_sq) return block_sum(sq, scratch, CONSUMERS, consumer_sync);
  consumer_sync();
  return 0.f;
}

template <int D, int BPS>
__global__ void __launch_bounds__(THREADS2, BPS) chain_v4(V4 B, int nstages, long long* prof) {
  extern __shared__ __align__(128) uint8_t smem[];
  const RingSmem m = ring_smem_init<D>(smem);  // xs: both chunks (k = 4,096) or down's current one
  const int G = gridDim.x, tid = threadIdx.x, warp = tid / 32;

  if (warp == CONSUMERS / 32) {  // the producer: this block's positions of every stage, in order
    if (tid % 32 == 0) {
      int i = 0;
      for (int s = 0; s < nstages; ++s) {
        const Stage& S = c_stages[s];
        for (int p = blockIdx.x; p < S.ntiles; p += G, ++i) {
          int kc, rt; v4_order(s % 4, S, p, kc, rt);
          const int slot = i % D;
          if (i >= D) mbar_wait_sleep(m.empty + slot, (i / D - 1) & 1);
          bulk_load(m.ring + slot * TILE_BYTES, S.tiles + (size_t)(kc * S.rowtiles + rt) * (TILE_BYTES / 16),
                    TILE_BYTES, m.full + slot);
        }
      }
    }
    return;
  }

  int i = 0;
  long long t_wait = 0, t_input = 0, t_all = 0;
  uint32_t xr[32];
  for (int s = 0; s < nstages; ++s) {
    const Stage& S = c_stages[s];
    const int l = s / 4, kind = s % 4;
    int* C = B.cnt + l * V4_CNT;
    int* Cprev = B.cnt + (l - 1) * V4_CNT;
    float* out_base = kind == 0 ? B.qkv + (size_t)l * 6144 : kind == 1 ? B.o + (size_t)l * 4096
                    : kind == 2 ? B.gu + (size_t)l * 28672 : B.d + (size_t)l * 4096;
    int loaded = 0, xr_kc = -1, down_kc = -1;  // loaded: bit c = chunk c is in xs (k = 4,096 stages)
    long long t_stage = prof && tid == 0 ? clock64() : 0;
    for (int p = blockIdx.x; p < S.ntiles; p += G, ++i) {
      int kc, rt; v4_order(kind, S, p, kc, rt);
      long long t0 = prof && tid == 0 ? clock64() : 0;
      if (tid == 0) {  // this tile's input chunk must be complete
        if (kind == 0 && l > 0) wait_at_least(Cprev + 18 + kc, 8 * 128 * 7);
        if (kind == 1) { wait_at_least(C + 0 + kc, 8 * 128 * 2); wait_at_least(C + 22, 2); }
        if (kind == 2) { wait_at_least(C + 2 + kc, 8 * 128 * 2); wait_at_least(C + 20 + kc, 1); }
        if (kind == 3) { wait_at_least(C + 4 + kc, 8 * 128 * 2); wait_at_least(C + 4 + 7 + kc, 8 * 128 * 2);
                         wait_at_least(C + 23, 2); }
      }
      consumer_sync();
      long long t1 = prof && tid == 0 ? clock64() : 0;
      const bool need = kind == 3 ? kc != down_kc : !(loaded >> kc & 1);
      if (need) {
        const int base = kc * KCHUNK, slot_x = kind == 3 ? 0 : base;
        __half* xd = m.xs + slot_x;
        float* gd = m.gsum + slot_x / GROUP;
        if (kind == 0) {
          const bool owner = blockIdx.x == (kc * S.rowtiles) % G;  // the block of the chunk's first position
          const float* a = l == 0 ? B.hin + base : B.hm + (size_t)(l - 1) * 4096 + base;
          const float* b = l == 0 ? nullptr : B.o + (size_t)(l - 1) * 4096 + base;
          const float* c3 = l == 0 ? nullptr : B.d + (size_t)(l - 1) * 4096 + base;
          float sq = v4_load_chunk(a, b, c3, nullptr, 1.f, xd, gd, owner ? B.hm + (size_t)l * 4096 + base : nullptr,
                                   owner, m.scratch);
          if (owner && tid == 0) {
            atomicAdd(B.ss + 2 * l, sq);
            __threadfence();
            atomicAdd(C + 20 + kc, 1);
            atomicAdd(C + 22, 1);
          }
        } else if (kind == 1) {
          const float sc = rsqrtf(__ldcg(B.ss + 2 * l) / 4096.f + 1e-5f);
          v4_load_chunk(B.qkv + (size_t)l * 6144 + base, nullptr, nullptr, nullptr, sc, xd, gd, nullptr, false, m.scratch);
        } else if (kind == 2) {
          // h_l + o_l; the owner of this chunk adds its sum of squares (down's RMSNorm)
          const bool owner = blockIdx.x == (kc * S.rowtiles) % G;
          float sq = v4_load_chunk(B.hm + (size_t)l * 4096 + base, B.o + (size_t)l * 4096 + base, nullptr, nullptr,
                                   1.f, xd, gd, nullptr, owner, m.scratch);
          if (owner && tid == 0) {
            atomicAdd(B.ss + 2 * l + 1, sq);
            __threadfence();
            atomicAdd(C + 23, 1);
          }
        } else {
          const float sc = rsqrtf(__ldcg(B.ss + 2 * l + 1) / 4096.f + 1e-5f);
          const float* g = B.gu + (size_t)l * 28672 + base;
          v4_load_chunk(g, nullptr, nullptr, g + 14336, sc, xd, gd, nullptr, false, m.scratch);
          down_kc = kc;
        }
        loaded |= 1 << kc;
        xr_kc = -1;
      }
      const int xoff = kind == 3 ? 0 : kc * KCHUNK;
      if (kc != xr_kc) { load_xr(m.xs + xoff, xr); xr_kc = kc; }
      long long t2 = prof && tid == 0 ? clock64() : 0;
      const int slot = i % D;
      mbar_wait_sleep(m.full + slot, (i / D) & 1);
      compute_tile_v2<true>(m.ring + slot * TILE_BYTES, xr, m.gsum + xoff / GROUP, out_base + rt * ROWS);
      __syncwarp();
      if (tid % 32 == 0) {
        mbar_arrive(m.empty + slot);
        const int row_chunk = rt * ROWS / KCHUNK;
        int* ready = kind == 0 ? (row_chunk < 2 ? C + 0 + row_chunk : nullptr) : kind == 1 ? C + 2 + row_chunk
                   : kind == 2 ? C + 4 + row_chunk : C + 18 + row_chunk;
        if (ready) { __threadfence(); atomicAdd(ready, 1); }
      }
      if (prof && tid == 0) { t_wait += t1 - t0; t_input += t2 - t1; }
    }
    if (prof && tid == 0) t_all += clock64() - t_stage;
  }
  if (prof && tid == 0) {
    long long* q = prof + (size_t)blockIdx.x * nstages * 4;
    q[0] = t_wait; q[1] = t_input; q[2] = t_all; q[3] = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// The reference: one launch a stage, a block a row, fp32 dequantisation, the same fp16 inputs.
__global__ void ref_prepare_x(int s, __half* x) {
  const Stage& S = c_stages[s];
  __shared__ float part[32];
  float scale = 1.f;
  if (S.in_kind == IN_RMSNORM) {
    float acc = 0.f;
    for (int i = threadIdx.x; i < S.k; i += blockDim.x) acc += S.in[i] * S.in[i];
    scale = rsqrtf(block_sum(acc, part, blockDim.x, block_sync) / S.k + 1e-5f);
  }
  for (int i = threadIdx.x; i < S.k; i += blockDim.x) {
    float v = S.in[i];
    if (S.in_kind == IN_SWIGLU) v = silu(v) * S.in[S.k + i];
    x[i] = __float2half(v * scale);
  }
}
__global__ void ref_gemv(int s, const __half* x) {
  const Stage& S = c_stages[s];
  const int row = blockIdx.x;
  float acc = 0.f;
  for (int k = threadIdx.x; k < S.k; k += blockDim.x) {
    int group = k / GROUP;
    float w = weight_scale(S.seed, row, group, S.k) *
              ((float)weight_q(S.seed, row, k) - (float)weight_zero(S.seed, row, group));
    acc += w * __half2float(x[k]);
  }
  __shared__ float part[32];
  const float total = block_sum(acc, part, blockDim.x, block_sync);
  if (threadIdx.x == 0) S.out[row] += total;
}

// ---------------------------------------------------------------------------------------------
struct Plan {
  std::vector<Stage> stages;
  size_t tile_bytes = 0;
  int total = 0;
};

// Llama-3.1-8B: hidden 4,096, q/k/v 4,096 + 1,024 + 1,024, intermediate 14,336 (gate and up).
static Plan make_plan(int layers, float* h, float* qkv_out, float* gu_out, uint8_t* weights) {
  Plan p;
  const int H = 4096, QKV = 6144, I = 14336;
  struct Shape { int k, rows, in_kind; };
  size_t off = 0;
  for (int l = 0; l < layers; ++l) {
    Shape sh[4] = {{H, QKV, IN_RMSNORM}, {H, H, IN_PLAIN}, {H, 2 * I, IN_RMSNORM}, {I, H, IN_SWIGLU}};
    for (int j = 0; j < 4; ++j) {
      Stage S{};
      S.k = sh[j].k; S.rows = sh[j].rows; S.in_kind = sh[j].in_kind; S.seed = l * 4 + j + 1;
      S.rowtiles = S.rows / ROWS; S.kchunks = S.k / KCHUNK; S.ntiles = S.rowtiles * S.kchunks;
      S.base = p.total;
      S.tiles = weights ? (const uint4*)(weights + off) : nullptr;
      float* qkv_l = qkv_out + (size_t)l * QKV;
      float* gu_l = gu_out + (size_t)l * 2 * I;
      if (j == 0) { S.in = h; S.out = qkv_l; }
      if (j == 1) { S.in = qkv_l; S.out = h; }       // q stands in for the attention output
      if (j == 2) { S.in = h; S.out = gu_l; }
      if (j == 3) { S.in = gu_l; S.out = h; }
      off += (size_t)S.ntiles * TILE_BYTES;
      p.total += S.ntiles;
      p.stages.push_back(S);
    }
  }
  p.tile_bytes = off;
  return p;
}

// The buffers every v1-v3 launch resets, and the figures' names.
struct Run {
  const Plan& p;
  int* done; float* h; const float* h0; float* qkv_out; float* gu_out;
  size_t qkv_bytes, gu_bytes;
  int sms, iters;
};

// Times one persistent kernel: `launch(grid, smem, prof)` starts it once (prof: the per-stage cycle
// records, or nullptr). Best of `iters` launches after two warm-ups; the last launch is the profiled
// one and is not timed. Prints the per-stage means and the time as two JSON lines headed `label`.
template <typename Launch>
static float time_persistent(const Run& r, const char* label, const void* kernel, int threads, size_t smem,
                             int per_sm_wanted, Launch launch) {
  const int nst = (int)r.p.stages.size(), grid = r.sms * per_sm_wanted;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  // every block must be resident, or the spin waits deadlock
  if (per_sm < per_sm_wanted) { fprintf(stderr, "%s: %d blocks do not fit an SM\n", label, per_sm_wanted); return -1.f; }
  long long* prof = nullptr;
  CHECK(cudaMalloc(&prof, (size_t)grid * nst * 4 * sizeof(long long)));
  CHECK(cudaMemset(prof, 0, (size_t)grid * nst * 4 * sizeof(long long)));
  cudaEvent_t a, b; CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
  float best = 1e9f, sum = 0.f;
  for (int it = 0; it < r.iters + 2; ++it) {
    CHECK(cudaMemsetAsync(r.done, 0, 2 * MAX_STAGES * sizeof(int)));
    CHECK(cudaMemsetAsync(r.qkv_out, 0, r.qkv_bytes));
    CHECK(cudaMemsetAsync(r.gu_out, 0, r.gu_bytes));
    CHECK(cudaMemcpyAsync(r.h, r.h0, 4096 * sizeof(float), cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(a));
    launch(grid, smem, it == r.iters + 1 ? prof : nullptr);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaGetLastError());
    float ms; CHECK(cudaEventElapsedTime(&ms, a, b));
    if (it >= 2 && it < r.iters + 1) { best = fminf(best, ms); sum += ms; }
  }
  // The profiled launch: mean us a stage of each GEMV, over the blocks that ran it.
  std::vector<long long> hp((size_t)grid * nst * 4);
  CHECK(cudaMemcpy(hp.data(), prof, hp.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(prof));
  int clock_khz = 0; CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  printf("{\"run\": \"stages\", %s, \"grid\": %d", label, grid);
  double token_us = 0;
  for (int j = 0; j < 4; ++j) {
    double sum4[4] = {0, 0, 0, 0}; long n = 0;
    for (int blk = 0; blk < grid; ++blk)
      for (int s = j; s < nst; s += 4) {
        const long long* q = &hp[((size_t)blk * nst + s) * 4];
        if (q[0] + q[1] + q[2] == 0) continue;
        for (int f = 0; f < 4; ++f) sum4[f] += q[f];
        ++n;
      }
    for (int f = 0; f < 4; ++f) sum4[f] = n ? sum4[f] / n / (clock_khz * 1e-3) : 0;
    token_us += (sum4[0] + sum4[1] + sum4[2]) * nst / 4;
    printf(", \"%s_us\": {\"spin\": %.2f, \"input\": %.2f, \"tiles\": %.2f, \"ring_wait\": %.2f}", names[j],
           sum4[0], sum4[1], sum4[2], sum4[3]);
  }
  printf(", \"sum_ms\": %.3f}\n", token_us * 1e-3);
  printf("{\"run\": \"chain\", %s, \"grid\": %d, \"best_ms\": %.4f, \"mean_ms\": %.4f, \"tb_per_s\": %.3f}\n",
         label, grid, best, sum / (r.iters - 1), r.p.tile_bytes / (best * 1e-3) / 1e12);
  fflush(stdout);
  return best;
}

template <int D, int MODE>
static float time_chain(const Run& r, int per_sm_wanted = 1) {
  char label[128];
  snprintf(label, sizeof label, "\"kernel\": \"v1\", \"D\": %d, \"mode\": %d", D, MODE);
  const size_t smem = D * TILE_BYTES + XMAX * 2 + (THREADS / 32) * ROWS * 4 + 32 * 4 + D * 8;
  const int nst = (int)r.p.stages.size();
  return time_persistent(r, label, (const void*)chain_kernel<D, MODE>, THREADS, smem, per_sm_wanted,
                         [&](int grid, size_t sm, long long* prof) {
                           chain_kernel<D, MODE><<<grid, THREADS, sm>>>(r.done, nst, r.p.total, prof);
                         });
}

template <int D, int BPS, bool ZFOLD, bool NOWAIT = false>
static float time_v2(const Run& r) {
  char label[128];
  snprintf(label, sizeof label, "\"kernel\": \"v2\", \"D\": %d, \"zfold\": %d, \"nowait\": %d", D,
           (int)ZFOLD, (int)NOWAIT);
  const size_t smem = D * TILE_BYTES + 4096 * 2 + 64 * 4 + 2 * D * 8;
  const int nst = (int)r.p.stages.size();
  return time_persistent(r, label, (const void*)chain_v2<D, BPS, ZFOLD, NOWAIT>, THREADS2, smem, BPS,
                         [&](int grid, size_t sm, long long* prof) {
                           chain_v2<D, BPS, ZFOLD, NOWAIT><<<grid, THREADS2, sm>>>(r.done, nst, prof);
                         });
}

template <int D, int BPS>
static float time_v3(const Run& r) {
  char label[128];
  snprintf(label, sizeof label, "\"kernel\": \"v3\", \"D\": %d", D);
  const size_t smem = D * TILE_BYTES + 4096 * 2 + 64 * 4 + 2 * D * 8 + D * 4;
  const int nst = (int)r.p.stages.size();
  return time_persistent(r, label, (const void*)chain_v3<D, BPS>, THREADS2, smem, BPS,
                         [&](int grid, size_t sm, long long* prof) {
                           chain_v3<D, BPS><<<grid, THREADS2, sm>>>(r.done, nst, prof);
                         });
}

// v4's buffers and launches; the final h is Hm[L-1] + O[L-1] + D[L-1], summed here for the check.
template <int D, int BPS>
static float time_v4(const Plan& p, int layers, const float* h0, int sms, int iters, std::vector<float>& h_out) {
  V4 B{};
  B.hin = h0;
  float *qkv, *gu, *o, *d, *hm, *ss; int* cnt;
  const size_t qkv_b = (size_t)layers * 6144 * 4, gu_b = (size_t)layers * 28672 * 4, v_b = (size_t)layers * 4096 * 4;
  CHECK(cudaMalloc(&qkv, qkv_b)); CHECK(cudaMalloc(&gu, gu_b)); CHECK(cudaMalloc(&o, v_b));
  CHECK(cudaMalloc(&d, v_b)); CHECK(cudaMalloc(&hm, v_b)); CHECK(cudaMalloc(&ss, layers * 2 * 4));
  CHECK(cudaMalloc(&cnt, (size_t)layers * V4_CNT * 4));
  B.qkv = qkv; B.gu = gu; B.o = o; B.d = d; B.hm = hm; B.ss = ss; B.cnt = cnt;
  const size_t smem = D * TILE_BYTES + 4096 * 2 + 64 * 4 + 2 * D * 8;
  CHECK(cudaFuncSetAttribute(chain_v4<D, BPS>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain_v4<D, BPS>, THREADS2, smem));
  if (per_sm < BPS) { fprintf(stderr, "v4 D=%d: %d blocks do not fit an SM\n", D, BPS); return -1.f; }
  const int grid = sms * BPS, nst = (int)p.stages.size();
  long long* prof; CHECK(cudaMalloc(&prof, (size_t)grid * nst * 4 * 8)); CHECK(cudaMemset(prof, 0, (size_t)grid * nst * 4 * 8));
  cudaEvent_t a, b; CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
  float best = 1e9f, sum = 0.f;
  for (int it = 0; it < iters + 2; ++it) {
    CHECK(cudaMemsetAsync(qkv, 0, qkv_b)); CHECK(cudaMemsetAsync(gu, 0, gu_b));
    CHECK(cudaMemsetAsync(o, 0, v_b)); CHECK(cudaMemsetAsync(d, 0, v_b));
    CHECK(cudaMemsetAsync(ss, 0, layers * 2 * 4)); CHECK(cudaMemsetAsync(cnt, 0, (size_t)layers * V4_CNT * 4));
    CHECK(cudaEventRecord(a));
    chain_v4<D, BPS><<<grid, THREADS2, smem>>>(B, nst, it == iters + 1 ? prof : nullptr);
    CHECK(cudaEventRecord(b)); CHECK(cudaEventSynchronize(b)); CHECK(cudaGetLastError());
    float ms; CHECK(cudaEventElapsedTime(&ms, a, b));
    if (it >= 2 && it < iters + 1) { best = fminf(best, ms); sum += ms; }
  }
  std::vector<long long> hp((size_t)grid * nst * 4);
  CHECK(cudaMemcpy(hp.data(), prof, hp.size() * 8, cudaMemcpyDeviceToHost));
  int clock_khz = 0; CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  double w = 0, in = 0, all = 0, all_max = 0;
  for (int g = 0; g < grid; ++g) {
    const long long* q = &hp[(size_t)g * nst * 4];
    w += q[0]; in += q[1]; all += q[2]; all_max = std::max(all_max, (double)q[2]);
  }
  const double us = clock_khz * 1e-3;
  printf("{\"run\": \"chain_v4\", \"D\": %d, \"grid\": %d, \"best_ms\": %.4f, \"mean_ms\": %.4f, \"tb_per_s\": %.3f, "
         "\"block_mean_us\": {\"waiting\": %.1f, \"inputs\": %.1f, \"all\": %.1f, \"all_max\": %.1f}}\n",
         D, grid, best, sum / (iters - 1), p.tile_bytes / (best * 1e-3) / 1e12, w / grid / us, in / grid / us,
         all / grid / us, all_max / us);
  fflush(stdout);
  std::vector<float> t1(4096), t2(4096), t3(4096);
  const size_t last = (size_t)(layers - 1) * 4096 * 4;
  CHECK(cudaMemcpy(t1.data(), (char*)hm + last, 4096 * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(t2.data(), (char*)o + last, 4096 * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(t3.data(), (char*)d + last, 4096 * 4, cudaMemcpyDeviceToHost));
  h_out.resize(4096);
  for (int k = 0; k < 4096; ++k) h_out[k] = t1[k] + t2[k] + t3[k];
  CHECK(cudaFree(qkv)); CHECK(cudaFree(gu)); CHECK(cudaFree(o)); CHECK(cudaFree(d)); CHECK(cudaFree(hm));
  CHECK(cudaFree(ss)); CHECK(cudaFree(cnt)); CHECK(cudaFree(prof));
  return best;
}

int main(int argc, char** argv) {
  const int layers = argc > 1 ? atoi(argv[1]) : 32, iters = argc > 2 ? atoi(argv[2]) : 20;
  cudaDeviceProp prop; CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  printf("{\"device\": \"%s\", \"sms\": %d, \"l2_mb\": %.1f, \"layers\": %d}\n", prop.name, sms,
         prop.l2CacheSize / 1048576.0, layers);

  float *h, *h0, *qkv_out, *gu_out; int* done; uint8_t* weights; __half* xref;
  const size_t qkv_bytes = (size_t)layers * 6144 * 4, gu_bytes = (size_t)layers * 2 * 14336 * 4;
  Plan sizing = make_plan(layers, nullptr, nullptr, nullptr, nullptr);
  CHECK(cudaMalloc(&weights, sizing.tile_bytes));
  CHECK(cudaMalloc(&h, 4096 * 4)); CHECK(cudaMalloc(&h0, 4096 * 4));
  CHECK(cudaMalloc(&qkv_out, qkv_bytes)); CHECK(cudaMalloc(&gu_out, gu_bytes));
  CHECK(cudaMalloc(&done, 2 * MAX_STAGES * sizeof(int))); CHECK(cudaMalloc(&xref, 2 * 14336 * 2));
  Plan p = make_plan(layers, h, qkv_out, gu_out, weights);
  CHECK(cudaMemcpyToSymbol(c_stages, p.stages.data(), p.stages.size() * sizeof(Stage)));
  for (size_t s = 0; s < p.stages.size(); ++s) {
    int64_t words = (int64_t)p.stages[s].ntiles * (TILE_BYTES / 4);
    fill_tiles<<<(unsigned)((words + 255) / 256), 256>>>((int)s);
  }
  std::vector<float> h_init(4096);
  for (int i = 0; i < 4096; ++i) h_init[i] = ((mix(i + 12345) & 0xffff) / 65536.f - 0.5f) * 3.4641f;
  CHECK(cudaMemcpy(h0, h_init.data(), 4096 * 4, cudaMemcpyHostToDevice));
  CHECK(cudaDeviceSynchronize());
  printf("{\"weights_gb\": %.4f, \"tiles\": %d, \"stages\": %zu}\n", p.tile_bytes / 1e9, p.total, p.stages.size());

  // The copy rate of this GPU (bytes read + written), the roofline's yardstick.
  {
    size_t n = (size_t)1 << 31; uint8_t *src, *dst;
    CHECK(cudaMalloc(&src, n)); CHECK(cudaMalloc(&dst, n));
    cudaEvent_t a, b; CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
    float best = 1e9f;
    for (int it = 0; it < 6; ++it) {
      CHECK(cudaEventRecord(a)); CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice));
      CHECK(cudaEventRecord(b)); CHECK(cudaEventSynchronize(b));
      float ms; CHECK(cudaEventElapsedTime(&ms, a, b)); if (it) best = fminf(best, ms);
    }
    printf("{\"run\": \"copy\", \"tb_per_s\": %.3f, \"roofline_ms\": %.4f}\n", 2.0 * n / (best * 1e-3) / 1e12,
           p.tile_bytes / (2.0 * n / (best * 1e-3)) * 1e3);
    CHECK(cudaFree(src)); CHECK(cudaFree(dst));
  }

  // Reference: separate launches, fp32 dequantisation.
  CHECK(cudaMemset(qkv_out, 0, qkv_bytes)); CHECK(cudaMemset(gu_out, 0, gu_bytes));
  CHECK(cudaMemcpy(h, h0, 4096 * 4, cudaMemcpyDeviceToDevice));
  for (size_t s = 0; s < p.stages.size(); ++s) {
    ref_prepare_x<<<1, 1024>>>((int)s, xref);
    ref_gemv<<<p.stages[s].rows, 256>>>((int)s, xref);
  }
  CHECK(cudaDeviceSynchronize()); CHECK(cudaGetLastError());
  std::vector<float> h_ref(4096), h_got(4096);
  CHECK(cudaMemcpy(h_ref.data(), h, 4096 * 4, cudaMemcpyDeviceToHost));

  auto check = [&](const char* what, const std::vector<float>* given = nullptr) {
    if (given) h_got = *given;
    else CHECK(cudaMemcpy(h_got.data(), h, 4096 * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0, maxabs = 0;
    for (int i = 0; i < 4096; ++i) {
      double d = h_got[i] - h_ref[i];
      num += d * d; den += (double)h_ref[i] * h_ref[i]; maxabs = fmax(maxabs, fabs(d));
    }
    printf("{\"run\": \"check\", \"of\": \"%s\", \"rel_l2\": %.3e, \"max_abs\": %.3e, \"ref_rms\": %.4f, \"ok\": %s}\n",
           what, sqrt(num / den), maxabs, sqrt(den / 4096), sqrt(num / den) < 1e-2 ? "true" : "false");
    fflush(stdout);
  };
const Run run{p, done, h, h0, qkv_out, gu_out, qkv_bytes, gu_bytes, sms, iters};
  // The rows of docs/perf.md's record (2026-11-29): v1 and its read-only and ring-only bounds, v2 (the
  // best) with and without the zero folded and with no stage waits, v3, v4.
  std::vector<float> hv4;
  time_chain<4, 0>(run, 2); check("v1 D4 x2");
  time_chain<4, 1>(run, 2);
  time_chain<4, 3>(run, 2);
  time_v2<5, 2, true>(run); check("v2 D5 x2, zero folded");
  time_v2<5, 2, false>(run); check("v2 D5 x2");
  time_v2<5, 2, true, true>(run);
  time_v3<5, 2>(run); check("v3 D5 x2");
  time_v4<5, 2>(p, layers, h0, sms, iters, hv4); check("v4 D5 x2, chunk dataflow", &hv4);
  return 0;
}
