// CUDA kernels of RWKV-4, with the same operands as the CPU handlers of cpu_rwkv4.cc: one thread
// per (batch row, channel), the step and its reverse from rwkv4_math.h.
#include "cuda_util.cuh"
#include "rwkv4_math.h"

namespace rwkv_ffi {
namespace {

template <typename T>
__global__ void rwkv4_forward_kernel(const float* w, const float* u, const T* k, const T* v,
                                     const Wkv4State* s0, T* y, Wkv4State* s_final,
                                     Wkv4State* ckpt, int64_t B, int64_t T_, int64_t C) {
  const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (id >= B * C) return;
  const int64_t b = id / C, c = id % C, chunks = (T_ + kChunk - 1) / kChunk;
  Wkv4State st = s0[id];
  const float wc = w[c], uc = u[c];
  for (int64_t t = 0; t < T_; ++t) {
    if (t % kChunk == 0) ckpt[(b * chunks + t / kChunk) * C + c] = st;
    const int64_t i = (b * T_ + t) * C + c;
    y[i] = from_f<T>(wkv4_step(st, wc, uc, to_f(k[i]), to_f(v[i])));
  }
  s_final[id] = st;
}

template <typename T>
__global__ void rwkv4_backward_kernel(const float* w, const float* u, const T* k, const T* v,
                                      const T* dy, const Wkv4State* ds_final,
                                      const Wkv4State* ckpt, float* dw, float* du, T* dk, T* dv,
                                      Wkv4State* ds0, int64_t B, int64_t T_, int64_t C) {
  const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (id >= B * C) return;
  const int64_t b = id / C, c = id % C, chunks = (T_ + kChunk - 1) / kChunk;
  const float wc = w[c], uc = u[c];
  float gw = 0.f, gu = 0.f;
  Wkv4State g = ds_final[id];
  Wkv4State states[kChunk];
  for (int64_t chunk = chunks - 1; chunk >= 0; --chunk) {
    const int64_t t0 = chunk * kChunk;
    const int len = (int)lmin(kChunk, T_ - t0);
    Wkv4State st = ckpt[(b * chunks + chunk) * C + c];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      states[t] = st;
      if (t < len) {
        const int64_t i = (b * T_ + t0 + t) * C + c;
        wkv4_step(st, wc, uc, to_f(k[i]), to_f(v[i]));
      }
    }
#pragma unroll
    for (int t = kChunk - 1; t >= 0; --t) {
      if (t < len) {
        const int64_t i = (b * T_ + t0 + t) * C + c;
        float gk, gv;
        wkv4_step_back(states[t], wc, uc, to_f(k[i]), to_f(v[i]), to_f(dy[i]), g, gw, gu, gk, gv);
        dk[i] = from_f<T>(gk);
        dv[i] = from_f<T>(gv);
      }
    }
  }
  ds0[id] = g;
  dw[id] = gw;
  du[id] = gu;
}

}  // namespace

ffi::Error Rwkv4ForwardCuda(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer u,
                            ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer s0,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s_final,
                            ffi::Result<ffi::AnyBuffer> ckpt) {
  Rwkv4Shape s;
  Checks c = check_rwkv4(w, u, k, v, s);
  if (c.ok()) check_rwkv4_forward(c, s0, *y, *s_final, *ckpt, k.element_type(), s);
  if (!c.ok()) return c.error("rwkv4 forward");
  const int threads = 128;
  const dim3 grid((unsigned)((s.B * s.C + threads - 1) / threads));
  return dispatch_cuda(k.element_type(), [&](auto t) -> ffi::Error {
    using T = decltype(t);
    if (grid.x == 0) return ffi::Error::Success();
    rwkv4_forward_kernel<T><<<grid, threads, 0, stream>>>(
        w.typed_data<float>(), u.typed_data<float>(), (const T*)k.untyped_data(),
        (const T*)v.untyped_data(), (const Wkv4State*)s0.untyped_data(), (T*)y->untyped_data(),
        (Wkv4State*)s_final->untyped_data(), (Wkv4State*)ckpt->untyped_data(), s.B, s.T, s.C);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? ffi::Error::Success()
                            : ffi::Error::Internal(std::string("rwkv_jax CUDA: ") + cudaGetErrorString(e));
  });
}

ffi::Error Rwkv4BackwardCuda(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer u,
                             ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dy,
                             ffi::AnyBuffer ds_final, ffi::AnyBuffer ckpt,
                             ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> du,
                             ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                             ffi::Result<ffi::AnyBuffer> ds0) {
  Rwkv4Shape s;
  Checks c = check_rwkv4(w, u, k, v, s);
  if (c.ok())
    check_rwkv4_backward(c, dy, ds_final, ckpt, *dw, *du, *dk, *dv, *ds0, k.element_type(), s);
  if (!c.ok()) return c.error("rwkv4 backward");
  const int threads = 128;
  const dim3 grid((unsigned)((s.B * s.C + threads - 1) / threads));
  return dispatch_cuda(k.element_type(), [&](auto t) -> ffi::Error {
    using T = decltype(t);
    if (grid.x == 0) return ffi::Error::Success();
    rwkv4_backward_kernel<T><<<grid, threads, 0, stream>>>(
        w.typed_data<float>(), u.typed_data<float>(), (const T*)k.untyped_data(),
        (const T*)v.untyped_data(), (const T*)dy.untyped_data(),
        (const Wkv4State*)ds_final.untyped_data(), (const Wkv4State*)ckpt.untyped_data(),
        dw->typed_data<float>(), du->typed_data<float>(), (T*)dk->untyped_data(),
        (T*)dv->untyped_data(), (Wkv4State*)ds0->untyped_data(), s.B, s.T, s.C);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? ffi::Error::Success()
                            : ffi::Error::Internal(std::string("rwkv_jax CUDA: ") + cudaGetErrorString(e));
  });
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv4ForwardCuda, Rwkv4ForwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV4_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv4BackwardCuda, Rwkv4BackwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV4_BWD_OPS);
