// The op library every CPU kernel file registers its ops into: torch.ops.<MINIVLLM_OPS_NAMESPACE>,
// one per build variant (kernels/cpu_kernels.py passes minivllm_cpu_avx512, _avx2 or _portable),
// each file adding its ops as a fragment.
#pragma once

#include <torch/library.h>

#ifndef MINIVLLM_OPS_NAMESPACE
#define MINIVLLM_OPS_NAMESPACE minivllm_cpu
#endif

// TORCH_LIBRARY_* paste their argument: going through a second macro expands the namespace first
#define MINIVLLM_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define MINIVLLM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
