// The FFI handler symbols. Each target has one CPU and one CUDA handler with the same operands,
// registered under the same name for the platforms "cpu" and "CUDA".
#pragma once

#include "xla/ffi/api/ffi.h"

// X(target name, handler stem): the CPU symbol is RwkvJax<stem>Cpu, the CUDA one RwkvJax<stem>Cuda.
#define RWKV_JAX_FFI_TARGETS(X)                   \
  X("rwkv_jax_rwkv7_fwd", Rwkv7Forward)           \
  X("rwkv_jax_rwkv7_bwd", Rwkv7Backward)          \
  X("rwkv_jax_rwkv7_step", Rwkv7Step)             \
  X("rwkv_jax_rwkv6_fwd", Rwkv6Forward)           \
  X("rwkv_jax_rwkv6_bwd", Rwkv6Backward)          \
  X("rwkv_jax_rwkv6_step", Rwkv6Step)             \
  X("rwkv_jax_rwkv4_fwd", Rwkv4Forward)           \
  X("rwkv_jax_rwkv4_bwd", Rwkv4Backward)

#define RWKV_JAX_DECLARE_CPU(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(RwkvJax##stem##Cpu);
#define RWKV_JAX_DECLARE_CUDA(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(RwkvJax##stem##Cuda);
