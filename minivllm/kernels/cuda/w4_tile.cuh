// The W4 tile format and its tensor-core dot product, shared by the engine's persistent decode
// kernel (w4_layer_tail.cu) and the standalone prototype scripts/persistent_gemv/chain.cu.
//
// A tile is 16 output rows x 2,048 k of int4 weights (group size 128), 17,408 bytes:
//   words [8 warps][16 k steps][32 lanes] uint32: the lane's m16n8k16 A fragment of that k step.
//     Lane l holds row r = l / 4 and r + 8, k = 256 warp + 16 step + 2 (l % 4) + {0, 1, 8, 9};
//     nibble p of the word (bits 4p..4p+3) holds, for p = 0..7:
//     (r, k) (r+8, k) (r, k+8) (r+8, k+8) (r, k+1) (r+8, k+1) (r, k+9) (r+8, k+9)
//   then [16 rows][16 groups] half2 {scale, 1024 + zero}.
// quant/w4_tiles.py writes it from the engine's layout (and reads it back, for the tests).
//
// Dequantisation is one LOP3 a register: (w & 0x000F000F) | 0x64006400 is the half2
// (1024 + q_lo, 1024 + q_hi); the mask 0x00F000F0 gives 1024 + 16 q of the next nibble. The zero
// is folded out: the tensor cores multiply 1024 + q directly and each group's product is
// corrected with the group's sum of inputs (gsum): sum (q - z) x = sum (1024 + q) x - (1024 + z) sum x.
#pragma once
#include <cuda_fp16.h>
#include <cstdint>

namespace w4tile {

constexpr int ROWS = 16;                 // output rows a tile covers (the mma's M)
constexpr int KCHUNK = 2048;             // k a tile covers
constexpr int GROUP = 128;               // group size
constexpr int GROUPS = KCHUNK / GROUP;   // 16 groups a tile row
constexpr int MATH_THREADS = 256;        // 8 warps, each 256 k of a tile
constexpr int WORD_BYTES = ROWS * KCHUNK / 2;               // 16,384
constexpr int TILE_BYTES = WORD_BYTES + ROWS * GROUPS * 4;  // 17,408

// ---- PTX helpers ---------------------------------------------------------------------------
__device__ inline uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ inline void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
// One bulk copy (the copy engine, no per-thread requests) of `bytes` into shared memory; the
// barrier's phase completes when they have all landed.
__device__ inline void bulk_load(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ inline void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
// The same wait, but the thread sleeps in the hardware until the phase completes (or the hint's
// nanoseconds pass) instead of spinning through issue slots the math warps need.
__device__ inline void mbar_wait_sleep(uint64_t* bar, int parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1, %2;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity), "r"(100000) : "memory");
}
__device__ inline void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ inline int load_acquire(const int* p) {
  int v; asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory"); return v;
}
// (x & mask) | magic in ONE instruction: written as C, the compiler emits two LOP3s (a LOP3 takes
// one immediate), which made the dequantisation twice as long.
__device__ inline uint32_t lop_or(uint32_t x, uint32_t mask, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(magic));
  return r;
}
__device__ inline uint32_t h2u(__half2 h) { return *(uint32_t*)&h; }
__device__ inline __half2 u2h(uint32_t u) { return *(__half2*)&u; }

__device__ inline void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The sum of v over the block's first n threads (n a multiple of 32): a shuffle tree a warp, the
// warps' partials through `scratch` (n / 32 floats), `sync` the barrier among those threads. Each
// gets the total.
template <typename Sync>
__device__ inline float block_sum(float v, float* scratch, int n, Sync sync) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  sync();
  float total = 0.f;
  for (int w = 0; w < n / 32; ++w) total += scratch[w];
  return total;
}

// ---- the tile's math -----------------------------------------------------------------------
// A lane's two rows' (scale, 1024 + zero) for the warp's two groups of a tile, and the zeros in the
// forms the unfolded dequantisation subtracts: 1024 + z for row r (plain nibbles), -(64 + z) for
// row r + 8 (nibbles 16x, scaled by 1/16).
__device__ inline void group_scales(const __half2* SZ, int r, int warp, __half2* sz_a, __half2* sz_b,
                                    uint32_t* zero_a, uint32_t* zero_b16) {
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
    sz_a[grp] = SZ[r * GROUPS + warp * 2 + grp];
    sz_b[grp] = SZ[(r + 8) * GROUPS + warp * 2 + grp];
    zero_a[grp] = h2u(__half2half2(__high2half(sz_a[grp])));
    zero_b16[grp] = h2u(__hsub2(__float2half2_rn(960.f), __half2half2(__high2half(sz_b[grp]))));
  }
}

// xr: this lane's B fragments of the warp's 256 k (k = 16m + 2q and + 8) of the chunk at xs, every
// B column = x (a matrix-vector product: the mma's 8 columns are the same vector).
__device__ inline void load_xr(const __half* xs, uint32_t* xr) {
  const uint32_t* X = (const uint32_t*)xs + (threadIdx.x / 32) * 128 + threadIdx.x % 4;
#pragma unroll
  for (int m = 0; m < 16; ++m) { xr[2 * m] = X[m * 8]; xr[2 * m + 1] = X[m * 8 + 4]; }
}

// A warp's share of one tile (16 rows x its 256 k) on the tensor cores: acc_a and acc_b are the
// partial sums of rows r = lane / 4 and r + 8 (every lane of a quad holds the same values). Four
// accumulator chains, so the mma latency does not serialise the tile. ZFOLD: the zero is folded
// out (gsum: the chunk's 16 group sums of x); else each dequantised register subtracts its zero
// before the product.
template <bool ZFOLD>
__device__ inline void tile_dot(const uint8_t* slot, const uint32_t* xr, const float* gsum, float& acc_a,
                                float& acc_b) {
  constexpr int CH = 4;
  const int warp = threadIdx.x / 32, r = threadIdx.x % 32 / 4;
  const uint32_t* W = (const uint32_t*)slot + warp * 16 * 32 + threadIdx.x % 32;
  const __half2* SZ = (const __half2*)(slot + WORD_BYTES);
  const uint32_t sixteenth = h2u(__float2half2_rn(1.f / 16.f));
  __half2 sz_a[2], sz_b[2];
  uint32_t zero_a[2], zero_b16[2];
  group_scales(SZ, r, warp, sz_a, sz_b, zero_a, zero_b16);
  float c[CH][4] = {};
#pragma unroll
  for (int m = 0; m < 16; ++m) {
    const int grp = m / 8, chain = grp * (CH / 2) + m % (CH / 2);
    uint32_t w = W[m * 32], w8 = w >> 8;
    uint32_t a0 = lop_or(w, 0x000F000Fu, 0x64006400u), a1 = lop_or(w, 0x00F000F0u, 0x64006400u);
    uint32_t a2 = lop_or(w8, 0x000F000Fu, 0x64006400u), a3 = lop_or(w8, 0x00F000F0u, 0x64006400u);
    if (!ZFOLD) {
      a0 = h2u(__hsub2(u2h(a0), u2h(zero_a[grp])));
      a1 = h2u(__hfma2(u2h(a1), u2h(sixteenth), u2h(zero_b16[grp])));
      a2 = h2u(__hsub2(u2h(a2), u2h(zero_a[grp])));
      a3 = h2u(__hfma2(u2h(a3), u2h(sixteenth), u2h(zero_b16[grp])));
    }
    mma16816(c[chain], a0, a1, a2, a3, xr[2 * m], xr[2 * m + 1]);
  }
  acc_a = acc_b = 0.f;
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
    float va = 0.f, vb = 0.f;
#pragma unroll
    for (int j = 0; j < CH / 2; ++j) { va += c[grp * (CH / 2) + j][0]; vb += c[grp * (CH / 2) + j][2]; }
    if (ZFOLD) {
      const float gs = gsum[warp * 2 + grp];
      const float za = __high2float(sz_a[grp]), zb = __high2float(sz_b[grp]) - 1024.f;
      va = va - za * gs;                              // (1024 + z) sum x
      vb = (vb - 1024.f * gs) * (1.f / 16.f) - zb * gs;
    }
    acc_a += __low2float(sz_a[grp]) * va;
    acc_b += __low2float(sz_b[grp]) * vb;
  }
}

}  // namespace w4tile
