// RWKV-7 training in chunks of kChunk (16) tokens on the GPU: the arithmetic of
// rwkv7_chunk_math.h, step for step as the CPU twin (cpu_rwkv7_chunk.cc) does it.
//
// One thread block (kThreads<D> threads) per (head, sequence) walks the sequence's chunks with the
// float32 state on chip (shared memory; the backward's state gradient at K = 128 lives in its
// own float32 output slot, dh0, which stays in L2). The forward saves the state at every chunk's
// start (checkpoint slots, common.h; bfloat16 for 16-bit inputs, the operand the backward's
// products take); the backward walks the chunks in reverse, computing every gradient of a chunk
// from its saved state and the state gradient at its end.
//
// For 16-bit inputs every product runs on tensor cores (nvcuda::wmma, float32 sums): those with
// the state ([C, K] x [K, V], [K, C] x [C, V]: q~ H, the state update, dO H^T...) and the in-chunk
// matrices' gradients on bfloat16 operands; the in-chunk matrices of a tame chunk, its key-side
// gradients through the factors and the products with float32 intermediates ((I - A_ab)^-1 X,
// A_qb U, A_ak^T dX) on TF32 operands; the float32 in-chunk matrices against the 16-bit inputs
// (A_qk V, A_ak V, A_qb^T dO, A_qk^T dO) as two bfloat16 halves (16 bits of mantissa together).
// The factors, the inverse's substitution and the state stay float32. Float32 inputs keep
// float32 products on CUDA cores.
#include "cuda_util.cuh"
#include "cuda_rwkv7_chunk_backward.cuh"
#include "cuda_rwkv7_chunk_forward.cuh"

namespace rwkv_ffi {

// The current GPU's shared memory per block (opt-in), 0 if it cannot be read.
int64_t max_shared_bytes();

namespace {

template <int D, typename T> constexpr size_t shared_bytes() {
  return std::max(Layout<D, T, false>::bytes, Layout<D, T, true>::bytes);
}

// The CUDA checks, and K == V (the kernels' tiles are square).
void check_chunked(Checks& c, const SeqShape& s) {
  check_cuda(c, s);
  c.require(s.K == s.V, "the chunked kernels need K == V, got K=" + std::to_string(s.K) +
                            ", V=" + std::to_string(s.V));
}

template <bool BACKWARD>
ffi::Error launch_chunked(cudaStream_t stream, ffi::DataType dtype, const SeqShape& s,
                          const ChunkArgs& args) {
  return dispatch_cuda(dtype, [&](auto t) {
    using T = decltype(t);
    return dispatch_head_size(s.K, [&](auto kc) -> ffi::Error {
      constexpr int D = decltype(kc)::value;
      // The kernels move rows of 16 bytes (inputs, outputs and gradients).
      const void* const rows[] = {args.r, args.w,  args.k,  args.v,  args.a,  args.b, args.d_o,
                                  args.o, args.dr, args.dw, args.dk, args.dv, args.da, args.db};
      for (const void* ptr : rows)
        if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
          return ffi::Error::InvalidArgument(
              "rwkv7 chunked kernels: a buffer is not 16-byte aligned (XLA aligns its buffers)");
      const size_t shared = Layout<D, T, BACKWARD>::bytes;
      if ((int64_t)shared > max_shared_bytes())
        return ffi::Error::InvalidArgument(
            "rwkv7 chunked kernels: K=" + std::to_string(D) + " needs " + std::to_string(shared) +
            " bytes of shared memory per block, this GPU has " +
            std::to_string(max_shared_bytes()));
      if constexpr (BACKWARD)
        return launch(rwkv7_chunk_backward_kernel<D, T>, dim3(s.H, s.N), kThreads<D>, shared, stream, args);
      else
        return launch(rwkv7_chunk_forward_kernel<D, T>, dim3(s.H, s.N), kThreads<D>, shared, stream, args);
    });
  });
}

}  // namespace

int64_t max_shared_bytes() {
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 0;
  return limit;
}

int64_t rwkv7_chunk_shared_bytes(int64_t K, int64_t itemsize) {
  if (K == 64) return itemsize == 4 ? shared_bytes<64, float>() : shared_bytes<64, __nv_bfloat16>();
  if (K == 128) return itemsize == 4 ? shared_bytes<128, float>() : shared_bytes<128, __nv_bfloat16>();
  return -1;
}

ffi::Error Rwkv7ChunkForwardCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer w,
                                 ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer a,
                                 ffi::AnyBuffer b, ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu,
                                 float scale, ffi::Result<ffi::AnyBuffer> o,
                                 ffi::Result<ffi::AnyBuffer> h_final,
                                 ffi::Result<ffi::AnyBuffer> ckpt) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  SeqShape s;
  Checks c = check_rwkv7_forward(ins, h0, cu, *o, *h_final, *ckpt, s, /*chunked=*/true);
  check_chunked(c, s);
  if (!c.ok()) return c.error("rwkv7 chunked forward");
  ChunkArgs p{r.untyped_data(), w.untyped_data(), k.untyped_data(), v.untyped_data(),
              a.untyped_data(), b.untyped_data(), nullptr, cu.typed_data(),
              h0.typed_data<float>(), h_final->typed_data<float>(), checkpoint_data<void>(*ckpt),
              o->untyped_data(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
              s.H, s.B * s.T, scale};
  return launch_chunked<false>(stream, r.element_type(), s, p);
}

ffi::Error Rwkv7ChunkBackwardCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer w,
                                  ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer a,
                                  ffi::AnyBuffer b, ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final,
                                  ffi::AnyBuffer ckpt, ffi::Buffer<ffi::S32> cu, float scale,
                                  ffi::Result<ffi::AnyBuffer> dr, ffi::Result<ffi::AnyBuffer> dw,
                                  ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                  ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db,
                                  ffi::Result<ffi::AnyBuffer> dh0) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  const ffi::AnyBuffer grads[6] = {*dr, *dw, *dk, *dv, *da, *db};
  SeqShape s;
  Checks c = check_rwkv7_backward(ins, d_o, dh_final, ckpt, cu, grads, *dh0, s, /*chunked=*/true);
  check_chunked(c, s);
  if (!c.ok()) return c.error("rwkv7 chunked backward");
  ChunkArgs p{r.untyped_data(), w.untyped_data(), k.untyped_data(), v.untyped_data(),
              a.untyped_data(), b.untyped_data(), d_o.untyped_data(), cu.typed_data(),
              dh_final.typed_data<float>(), dh0->typed_data<float>(), ckpt.untyped_data(),
              nullptr, dr->untyped_data(), dw->untyped_data(), dk->untyped_data(),
              dv->untyped_data(), da->untyped_data(), db->untyped_data(), s.H, s.B * s.T, scale};
  return launch_chunked<true>(stream, r.element_type(), s, p);
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ChunkForwardCuda, Rwkv7ChunkForwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ChunkBackwardCuda, Rwkv7ChunkBackwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_BWD_OPS);
