// The FFI handler symbols. Each target has one CPU and one CUDA handler with the same operands,
// registered under the same name for the platforms "cpu" and "CUDA".
#pragma once

#include "xla/ffi/api/ffi.h"

// X(target name, handler stem): the CPU symbol is RwkvJax<stem>Cpu, the CUDA one RwkvJax<stem>Cuda.
#define RWKV_JAX_FFI_TARGETS(X)                   \
  X("rwkv_jax_rwkv7_fwd", Rwkv7Forward)           \
  X("rwkv_jax_rwkv7_bwd", Rwkv7Backward)          \
  X("rwkv_jax_rwkv7_step", Rwkv7Step)             \
  X("rwkv_jax_rwkv7_chunk_fwd", Rwkv7ChunkForward) \
  X("rwkv_jax_rwkv7_chunk_bwd", Rwkv7ChunkBackward) \
  X("rwkv_jax_rwkv6_fwd", Rwkv6Forward)           \
  X("rwkv_jax_rwkv6_bwd", Rwkv6Backward)          \
  X("rwkv_jax_rwkv6_step", Rwkv6Step)             \
  X("rwkv_jax_rwkv4_fwd", Rwkv4Forward)           \
  X("rwkv_jax_rwkv4_bwd", Rwkv4Backward)

// Operands of each target after the platform's context; the same for both platforms.
#define RWKV_JAX_A .Arg<xla::ffi::AnyBuffer>()
#define RWKV_JAX_R .Ret<xla::ffi::AnyBuffer>()
#define RWKV_JAX_A2 RWKV_JAX_A RWKV_JAX_A
#define RWKV_JAX_A4 RWKV_JAX_A2 RWKV_JAX_A2
#define RWKV_JAX_R2 RWKV_JAX_R RWKV_JAX_R
#define RWKV_JAX_R4 RWKV_JAX_R2 RWKV_JAX_R2
#define RWKV_JAX_SEGMENTS_SCALE .Arg<xla::ffi::Buffer<xla::ffi::S32>>().Attr<float>("scale")
#define RWKV_JAX_RWKV7_FWD_OPS RWKV_JAX_A4 RWKV_JAX_A2 RWKV_JAX_A RWKV_JAX_SEGMENTS_SCALE RWKV_JAX_R2 RWKV_JAX_R
#define RWKV_JAX_RWKV7_BWD_OPS \
  RWKV_JAX_A4 RWKV_JAX_A4 RWKV_JAX_A RWKV_JAX_SEGMENTS_SCALE RWKV_JAX_R4 RWKV_JAX_R2 RWKV_JAX_R
#define RWKV_JAX_RWKV7_STEP_OPS RWKV_JAX_A4 RWKV_JAX_A2 RWKV_JAX_A RWKV_JAX_SEGMENTS_SCALE RWKV_JAX_R2
#define RWKV_JAX_RWKV6_FWD_OPS RWKV_JAX_A4 RWKV_JAX_A2 RWKV_JAX_SEGMENTS_SCALE RWKV_JAX_R2 RWKV_JAX_R
#define RWKV_JAX_RWKV6_BWD_OPS RWKV_JAX_A4 RWKV_JAX_A4 RWKV_JAX_SEGMENTS_SCALE RWKV_JAX_R4 RWKV_JAX_R2
#define RWKV_JAX_RWKV6_STEP_OPS RWKV_JAX_A4 RWKV_JAX_A2 RWKV_JAX_SEGMENTS_SCALE RWKV_JAX_R2
#define RWKV_JAX_RWKV4_FWD_OPS RWKV_JAX_A4 RWKV_JAX_A RWKV_JAX_R2 RWKV_JAX_R
#define RWKV_JAX_RWKV4_BWD_OPS RWKV_JAX_A4 RWKV_JAX_A2 RWKV_JAX_A RWKV_JAX_R4 RWKV_JAX_R

#define RWKV_JAX_DECLARE_CPU(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(RwkvJax##stem##Cpu);
#define RWKV_JAX_DECLARE_CUDA(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(RwkvJax##stem##Cuda);
