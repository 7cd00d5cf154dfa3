// RWKV-4 on the CPU: forward with state and checkpoints, and the backward for w, u, k, v and the
// initial state. One task per (batch row, block of channels); channels are independent scalars.
#include "cpu_util.h"
#include "handlers.h"
#include "rwkv4_math.h"

namespace rwkv_ffi {
namespace {

constexpr int64_t kChannelBlock = 64;

using Shapes = Rwkv4Shape;

template <typename T>
ffi::Error forward(ffi::AnyBuffer w, ffi::AnyBuffer u, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer s0, const Shapes& s, ffi::Result<ffi::AnyBuffer> y,
                   ffi::Result<ffi::AnyBuffer> s_final, ffi::Result<ffi::AnyBuffer> ckpt) {
  const int64_t blocks = (s.C + kChannelBlock - 1) / kChannelBlock;
  const auto* init = reinterpret_cast<const Wkv4State*>(s0.typed_data<float>());
  auto* fin = reinterpret_cast<Wkv4State*>(s_final->typed_data<float>());
  auto* cp = reinterpret_cast<Wkv4State*>(ckpt->typed_data<float>());
  parallel_for(s.B * blocks, s.T * kChannelBlock * 30, [&](int64_t task) {
    const int64_t b = task / blocks, c0 = (task % blocks) * kChannelBlock;
    const int64_t c1 = std::min(c0 + kChannelBlock, s.C);
    const T* kp = ptr<T>(k) + b * s.T * s.C;
    const T* vp = ptr<T>(v) + b * s.T * s.C;
    T* yp = ptr<T>(*y) + b * s.T * s.C;
    for (int64_t c = c0; c < c1; ++c) {
      Wkv4State st = init[b * s.C + c];
      const float wc = w.typed_data<float>()[c], uc = u.typed_data<float>()[c];
      for (int64_t t = 0; t < s.T; ++t) {
        if (t % kChunk == 0) cp[(b * s.chunks + t / kChunk) * s.C + c] = st;
        const int64_t i = t * s.C + c;
        yp[i] = from_float<T>(wkv4_step(st, wc, uc, to_float(kp[i]), to_float(vp[i])));
      }
      fin[b * s.C + c] = st;
    }
  });
  return ffi::Error::Success();
}

template <typename T>
ffi::Error backward(ffi::AnyBuffer w, ffi::AnyBuffer u, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer dy, ffi::AnyBuffer ds_final, ffi::AnyBuffer ckpt,
                    const Shapes& s, ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> du,
                    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                    ffi::Result<ffi::AnyBuffer> ds0) {
  const int64_t blocks = (s.C + kChannelBlock - 1) / kChannelBlock;
  const auto* gfin = reinterpret_cast<const Wkv4State*>(ds_final.typed_data<float>());
  const auto* cp = reinterpret_cast<const Wkv4State*>(ckpt.typed_data<float>());
  auto* g0 = reinterpret_cast<Wkv4State*>(ds0->typed_data<float>());
  parallel_for(s.B * blocks, s.T * kChannelBlock * 80, [&](int64_t task) {
    const int64_t b = task / blocks, c0 = (task % blocks) * kChannelBlock;
    const int64_t c1 = std::min(c0 + kChannelBlock, s.C);
    const int64_t off = b * s.T * s.C;
    const T* kp = ptr<T>(k) + off;
    const T* vp = ptr<T>(v) + off;
    const T* dyp = ptr<T>(dy) + off;
    T* dkp = ptr<T>(*dk) + off;
    T* dvp = ptr<T>(*dv) + off;
    Wkv4State states[kChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const float wc = w.typed_data<float>()[c], uc = u.typed_data<float>()[c];
      float gw = 0.f, gu = 0.f;
      Wkv4State g = gfin[b * s.C + c];
      for (int64_t chunk = s.chunks - 1; chunk >= 0; --chunk) {
        const int64_t t0 = chunk * kChunk, t1 = std::min(t0 + kChunk, s.T);
        Wkv4State st = cp[(b * s.chunks + chunk) * s.C + c];
        for (int64_t t = t0; t < t1; ++t) {
          states[t - t0] = st;
          const int64_t i = t * s.C + c;
          wkv4_step(st, wc, uc, to_float(kp[i]), to_float(vp[i]));
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
          const int64_t i = t * s.C + c;
          float gk, gv;
          wkv4_step_back(states[t - t0], wc, uc, to_float(kp[i]), to_float(vp[i]),
                         to_float(dyp[i]), g, gw, gu, gk, gv);
          dkp[i] = from_float<T>(gk);
          dvp[i] = from_float<T>(gv);
        }
      }
      g0[b * s.C + c] = g;
      dw->typed_data<float>()[b * s.C + c] = gw;
      du->typed_data<float>()[b * s.C + c] = gu;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Rwkv4ForwardCpu(ffi::AnyBuffer w, ffi::AnyBuffer u, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer s0, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> s_final, ffi::Result<ffi::AnyBuffer> ckpt) {
  Rwkv4Shape s;
  Checks c = check_rwkv4(w, u, k, v, s);
  if (c.ok()) check_rwkv4_forward(c, s0, *y, *s_final, *ckpt, k.element_type(), s);
  if (!c.ok()) return c.error("rwkv4 forward");
  return dispatch_float(k.element_type(), "rwkv4 forward", [&]<typename T>() {
    return forward<T>(w, u, k, v, s0, s, y, s_final, ckpt);
  });
}

ffi::Error Rwkv4BackwardCpu(ffi::AnyBuffer w, ffi::AnyBuffer u, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer dy, ffi::AnyBuffer ds_final,
                            ffi::AnyBuffer ckpt, ffi::Result<ffi::AnyBuffer> dw,
                            ffi::Result<ffi::AnyBuffer> du, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> ds0) {
  Rwkv4Shape s;
  Checks c = check_rwkv4(w, u, k, v, s);
  if (c.ok())
    check_rwkv4_backward(c, dy, ds_final, ckpt, *dw, *du, *dk, *dv, *ds0, k.element_type(), s);
  if (!c.ok()) return c.error("rwkv4 backward");
  return dispatch_float(k.element_type(), "rwkv4 backward", [&]<typename T>() {
    return backward<T>(w, u, k, v, dy, ds_final, ckpt, s, dw, du, dk, dv, ds0);
  });
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv4ForwardCpu, Rwkv4ForwardCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV4_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv4BackwardCpu, Rwkv4BackwardCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV4_BWD_OPS);
