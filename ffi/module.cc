// The Python modules rwkv_jax._ffi_cpu and rwkv_jax._ffi_cuda: the handlers as capsules for
// jax.ffi.register_ffi_target. Compiled once per platform (RWKV_JAX_CUDA set for the CUDA one),
// so that a CPU-only machine never loads the CUDA runtime.
#include <nanobind/nanobind.h>

#include "common.h"
#include "handlers.h"

namespace nb = nanobind;

#ifdef RWKV_JAX_CUDA
RWKV_JAX_FFI_TARGETS(RWKV_JAX_DECLARE_CUDA)
namespace rwkv_ffi {
int64_t rwkv7_chunk_shared_bytes(int64_t K, int64_t itemsize);
int64_t max_shared_bytes();
}  // namespace rwkv_ffi
#define RWKV_JAX_HANDLER(stem) RwkvJax##stem##Cuda
#define RWKV_JAX_MODULE _ffi_cuda
#else
RWKV_JAX_FFI_TARGETS(RWKV_JAX_DECLARE_CPU)
#define RWKV_JAX_HANDLER(stem) RwkvJax##stem##Cpu
#define RWKV_JAX_MODULE _ffi_cpu
#endif

NB_MODULE(RWKV_JAX_MODULE, m) {
  m.attr("checkpoint_chunk") = rwkv_ffi::kChunk;
  m.def("registrations", []() {
    nb::dict targets;
#define RWKV_JAX_ADD(name, stem) \
  targets[name] = nb::capsule(reinterpret_cast<void*>(RWKV_JAX_HANDLER(stem)));
    RWKV_JAX_FFI_TARGETS(RWKV_JAX_ADD)
#undef RWKV_JAX_ADD
    return targets;
  });
#ifdef RWKV_JAX_CUDA
  // The chunked rwkv7 kernels' shared memory per block (the larger of forward and backward) for
  // head size K and input itemsize, and the current GPU's limit per block.
  m.def("rwkv7_chunk_shared_bytes", &rwkv_ffi::rwkv7_chunk_shared_bytes);
  m.def("max_shared_bytes", &rwkv_ffi::max_shared_bytes);
#endif
}
