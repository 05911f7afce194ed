// The decoder's small ops for the CPU, float32, one pass each (models/cpu_forward.py calls them).
//
// Why: between two matrix products a decoder layer ran ~25 small PyTorch ops (norm, residual
// add, rotary, K/V store, SiLU-and-multiply). On the CPU each costs a dispatch, and after a
// matrix product that streamed megabytes of weights each runs ~3x slower than warm
// (docs/perf.md, W5 run 6). Here they are four calls a layer.
//
//   add_rms_norm(residual [T, H], hidden [T, H]?, weight [H], eps) -> [T, H]
//       residual += hidden (in place, when given); returns residual * rsqrt(mean(residual^2) + eps) * weight
//   rope_store_kv(qkv [T, (Hq + 2 Hk) D], positions [T] int64, cos_sin [P, D], Hq, Hk, k_cache, v_cache,
//                 slot_mapping [T] int64)
//       rotates q and k in place (neox halves: [x1 cos - x2 sin | x2 cos + x1 sin], cos_sin = [cos | sin]
//       of each position), then writes k and v of token t into cache slot slot_mapping[t] (skipped when -1)
//   silu_mul(gate_up [T, 2 I]) -> [T, I] = silu(gate) * up
//
// Rows are independent: at::parallel_for over tokens. Results equal the PyTorch ops up to float32
// rounding (the sum of squares is added in a different order; tests/unit/test_cpu_kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "op_library.h"
#include "vec_math.h"

namespace {

constexpr int kLanes = 16;  // partial sums kept apart so the loop vectorizes without reassociation flags

inline float sum_of_squares(const float* x, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  float s = 0.f;
  for (; i < n; ++i) s += x[i] * x[i];
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

void check_cpu_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

}  // namespace

at::Tensor add_rms_norm(at::Tensor& residual, const std::optional<at::Tensor>& hidden, const at::Tensor& weight,
                        double eps) {
  check_cpu_float(residual, "residual");
  check_cpu_float(weight, "weight");
  TORCH_CHECK(residual.dim() == 2 && weight.dim() == 1 && weight.size(0) == residual.size(1),
              "add_rms_norm: residual [T, H] and weight [H]");
  if (hidden.has_value()) {
    check_cpu_float(*hidden, "hidden");
    TORCH_CHECK(hidden->sizes() == residual.sizes(), "add_rms_norm: hidden must be shaped like residual");
  }
  const int64_t T = residual.size(0), H = residual.size(1);
  at::Tensor out = at::empty_like(residual);
  float* r = residual.data_ptr<float>();
  const float* h = hidden.has_value() ? hidden->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* rt = r + t * H;
      if (h != nullptr)
        for (int64_t i = 0; i < H; ++i) rt[i] += h[t * H + i];
      const float rstd = 1.f / std::sqrt(sum_of_squares(rt, H) / static_cast<float>(H) + e);
      for (int64_t i = 0; i < H; ++i) o[t * H + i] = rt[i] * rstd * w[i];
    }
  });
  return out;
}

void rope_store_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t num_heads,
                   int64_t num_kv_heads, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cpu_float(qkv, "qkv");
  check_cpu_float(cos_sin, "cos_sin");
  check_cpu_float(k_cache, "k_cache");
  check_cpu_float(v_cache, "v_cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
              slot_mapping.is_contiguous(), "rope_store_kv: positions and slot_mapping must be contiguous int64");
  const int64_t T = qkv.size(0), D = cos_sin.size(1), half = D / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D && D % 2 == 0,
              "rope_store_kv: qkv must be [T, (Hq + 2 Hk) * D]");
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T, "rope_store_kv: one position and slot per token");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads && k_cache.size(3) == D &&
              v_cache.sizes() == k_cache.sizes(), "rope_store_kv: caches must be [N, bs, Hk, D]");
  const int64_t max_pos = cos_sin.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope_store_kv: position ", pos[t], " outside [0, ", max_pos, ")");
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "rope_store_kv: slot ", slots[t], " outside [-1, ", num_slots, ")");
  }
  float* x = qkv.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t row = qkv.size(1), rotated = (num_heads + num_kv_heads) * D, kv_width = num_kv_heads * D;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pos[t] * D;
      const float* s = c + half;
      float* xt = x + t * row;
      for (int64_t hd = 0; hd < rotated; hd += D) {  // every q head, then every k head
        float* x1 = xt + hd;
        float* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
      if (slots[t] >= 0) {
        std::copy(xt + num_heads * D, xt + rotated, kc + slots[t] * kv_width);
        std::copy(xt + rotated, xt + rotated + kv_width, vc + slots[t] * kv_width);
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [T, 2 I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) minivllm_vec::silu_mul_row(g + t * 2 * I, g + t * 2 * I + I, o + t * I, I);
  });
  return out;
}

MINIVLLM_FRAGMENT(MINIVLLM_OPS_NAMESPACE, m) {
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? hidden, Tensor weight, float eps) -> Tensor");
  m.def("rope_store_kv(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, int num_heads, int num_kv_heads, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

MINIVLLM_LIBRARY_IMPL(MINIVLLM_OPS_NAMESPACE, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store_kv", &rope_store_kv);
  m.impl("silu_mul", &silu_mul);
}
