// The FFI handlers of the RWKV-7 CUDA kernels of cuda_rwkv7.cuh (training forward/backward,
// inference step): shape checks, then one launch.
#include "cuda_util.cuh"
#include "cuda_rwkv7.cuh"

namespace rwkv_ffi {
namespace {

ffi::Error rwkv7_forward(cudaStream_t stream, Buffers ins, const SeqShape& s, const int* cu,
                         const int* rows, int64_t pool_rows, const float* h_in, float* h_out,
                         float* ckpt, void* o, int64_t n_seq, float scale) {
  Rwkv7Args p{{cu, rows, pool_rows, h_in, h_out, ckpt, o, s.H, s.V, s.T, s.B * s.T, scale},
              ins[0].untyped_data(), ins[1].untyped_data(), ins[2].untyped_data(),
              ins[3].untyped_data(), ins[4].untyped_data(), ins[5].untyped_data()};
  return dispatch_type_and_head_size(ins[0].element_type(), s.K, [&](auto t, auto kc) {
    using T = decltype(t);
    constexpr int K = decltype(kc)::value;
    return launch(rwkv7_forward_kernel<K, T>, dim3(s.H, n_seq), s.V,
                  rwkv7_forward_shared_bytes<K>(s.V), stream, p);
  });
}

}  // namespace

ffi::Error Rwkv7ForwardCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer w,
                            ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer a,
                            ffi::AnyBuffer b, ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu,
                            float scale, ffi::Result<ffi::AnyBuffer> o,
                            ffi::Result<ffi::AnyBuffer> h_final, ffi::Result<ffi::AnyBuffer> ckpt) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  SeqShape s;
  Checks c = check_rwkv7_forward(ins, h0, cu, *o, *h_final, *ckpt, s);
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv7 forward");
  return rwkv7_forward(stream, ins, s, cu.typed_data(), nullptr, 0, h0.typed_data<float>(),
                       h_final->typed_data<float>(), checkpoint_data(*ckpt),
                       o->untyped_data(), s.N, scale);
}

ffi::Error Rwkv7BackwardCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer w,
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
  Checks c = check_rwkv7_backward(ins, d_o, dh_final, ckpt, cu, grads, *dh0, s);
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv7 backward");
  Rwkv7BackArgs p{{cu.typed_data(), dh_final.typed_data<float>(), ckpt.typed_data<float>(),
                   dh0->typed_data<float>(), s.H, s.V, s.B * s.T, scale},
                  r.untyped_data(), w.untyped_data(), k.untyped_data(), v.untyped_data(),
                  a.untyped_data(), b.untyped_data(), d_o.untyped_data(), dr->untyped_data(),
                  dw->untyped_data(), dk->untyped_data(), dv->untyped_data(), da->untyped_data(),
                  db->untyped_data()};
  return dispatch_type_and_head_size(r.element_type(), s.K, [&](auto t, auto kc) {
    using T = decltype(t);
    constexpr int K = decltype(kc)::value;
    return launch(rwkv7_backward_kernel<K, T>, dim3(s.H, s.N), s.V,
                  rwkv7_backward_shared_bytes<K>(s.V), stream, p);
  });
}

ffi::Error Rwkv7StepCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer w,
                         ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::AnyBuffer pool_in, ffi::Buffer<ffi::S32> rows, float scale,
                         ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> pool) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  SeqShape s;
  Checks c = check_rwkv7(ins, s);
  if (c.ok()) check_step(c, pool_in, rows, *o, *pool, r.element_type(), s);
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv7_step");
  // Rows outside the pool are skipped on the device (checking them here would need a copy).
  return rwkv7_forward(stream, ins, s, nullptr, rows.typed_data(), s.N,
                       pool->typed_data<float>(), pool->typed_data<float>(), nullptr,
                       o->untyped_data(), s.B, scale);
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ForwardCuda, Rwkv7ForwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7BackwardCuda, Rwkv7BackwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_BWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7StepCuda, Rwkv7StepCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_STEP_OPS,
                              {ffi::Traits::kCmdBufferCompatible});
