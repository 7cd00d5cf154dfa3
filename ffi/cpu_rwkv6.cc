// RWKV-6 on the CPU: training forward/backward and the inference step.
//
//   o_t = (h_{t-1} + diag(u) k_t v_t^T)^T (scale r_t),   h_t = diag(exp(w_t)) h_{t-1} + k_t v_t^T
//
// Same structure as cpu_rwkv7.cc: one task per (sequence, head), checkpoints every kChunk steps,
// and a backward that recomputes a chunk's states and runs dh_{t-1} = diag(exp w_t) dh_t + rs_t do_t^T.
#include "cpu_util.h"
#include "handlers.h"

namespace rwkv_ffi {
namespace {

struct Dims {
  int64_t H, K, V;
};

struct Token {
  std::vector<float> rs, k, ew, v;
  Token(const Dims& d) : rs(d.K), k(d.K), ew(d.K), v(d.V) {}
  template <typename T>
  void load_at(const T* const in[4], int64_t g, int64_t h, const Dims& d, float scale) {
    const int64_t ok = (g * d.H + h) * d.K;
    load(in[0] + ok, rs.data(), d.K);
    load(in[1] + ok, k.data(), d.K);
    load(in[2] + (g * d.H + h) * d.V, v.data(), d.V);
    load(in[3] + ok, ew.data(), d.K);
    for (int64_t i = 0; i < d.K; ++i) rs[i] *= scale;
    vexp_inplace(ew.data(), d.K);
  }
};

// out = h^T rs + (rs . (u * k)) v, then h = diag(ew) h + k v^T (in place). VC: the value size
// when known at compile time (loops unroll, V-vectors stay in registers), else 0.
template <int VC>
void step(const Token& x, const float* u, float* h, float* out, const Dims& d) {
  const int64_t K = d.K, V = VC ? VC : d.V;
  alignas(64) float o[VC ? VC : kMaxValueSize];
  float bonus = 0.f;
  for (int64_t i = 0; i < K; ++i) bonus += x.rs[i] * u[i] * x.k[i];
  const float* v = x.v.data();
  for (int64_t j = 0; j < V; ++j) o[j] = bonus * v[j];
  for (int64_t i = 0; i < K; ++i) {
    const float e = x.ew[i], ki = x.k[i], ri = x.rs[i];
    float* row = h + i * V;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      o[j] += ri * row[j];
      row[j] = row[j] * e + ki * v[j];
    }
  }
  if (out) std::copy(o, o + V, out);
}

// Reverse of one step from hp = h_{t-1}: G holds dL/dh_t on entry and dL/dh_{t-1} on return;
// writes the gradients of this step's r, k, v, w and adds to g_u.
template <int VC>
void step_back(const Token& x, const float* u, const float* hp, const float* d_out, float* G,
               float* g_r, float* g_k, float* g_v, float* g_w, float* g_u, float scale,
               const Dims& d) {
  const int64_t K = d.K, V = VC ? VC : d.V;
  alignas(64) float dv[VC ? VC : kMaxValueSize];
  const float* v = x.v.data();
  float v_do = 0.f, bonus = 0.f;
#pragma omp simd reduction(+ : v_do)
  for (int64_t j = 0; j < V; ++j) v_do += v[j] * d_out[j];
  for (int64_t i = 0; i < K; ++i) bonus += x.rs[i] * u[i] * x.k[i];
  for (int64_t j = 0; j < V; ++j) dv[j] = bonus * d_out[j];
  for (int64_t i = 0; i < K; ++i) {
    const float* h = hp + i * V;
    float* g = G + i * V;
    const float e = x.ew[i], ki = x.k[i], ri = x.rs[i];
    float h_do = 0.f, g_v = 0.f, g_h = 0.f;
#pragma omp simd reduction(+ : h_do, g_v, g_h)
    for (int64_t j = 0; j < V; ++j) {
      const float gj = g[j];
      dv[j] += ki * gj;
      h_do += h[j] * d_out[j];
      g_v += gj * v[j];
      g_h += gj * h[j];
      g[j] = e * gj + ri * d_out[j];  // dh_{t-1} = diag(ew) dh_t + rs do^T
    }
    g_r[i] = scale * (h_do + u[i] * ki * v_do);
    g_k[i] = g_v + ri * u[i] * v_do;
    g_w[i] = e * g_h;
    g_u[i] += ri * ki * v_do;
  }
  std::copy(dv, dv + V, g_v);
}

template <typename T, int VC>
void forward_sequence(const T* const in[4], const float* u, T* o, float* h, float* ckpt,
                      int64_t slot_stride, int64_t start, int64_t end, int64_t hd, float scale,
                      const Dims& d) {
  Token x(d);
  std::vector<float> out(d.V);
  for (int64_t g = start; g < end; ++g) {
    if (ckpt && (g - start) % kChunk == 0)
      std::memcpy(ckpt + ((g - start) / kChunk) * slot_stride, h, sizeof(float) * d.K * d.V);
    x.load_at(in, g, hd, d, scale);
    step<VC>(x, u, h, out.data(), d);
    store(out.data(), o + (g * d.H + hd) * d.V, d.V);
  }
}

struct Shapes {
  int64_t B, T, H, K, V;
};
Shapes shapes_of(const ffi::AnyBuffer* ins) {
  auto d = ins[0].dimensions();
  return {d[0], d[1], d[2], d[3], ins[2].dimensions()[3]};
}

template <typename T>
ffi::Error forward(const ffi::AnyBuffer* ins, ffi::AnyBuffer u, ffi::AnyBuffer h0,
                   ffi::Buffer<ffi::S32> cu, float scale, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::AnyBuffer> h_final, ffi::Result<ffi::AnyBuffer> ckpt) {
  const Shapes s = shapes_of(ins);
  const int64_t N = cu.dimensions()[0] - 1, kv = s.K * s.V;
  const Dims d{s.H, s.K, s.V};
  const T* in[4];
  for (int i = 0; i < 4; ++i) in[i] = ptr<T>(ins[i]);
  const int32_t* seg = cu.typed_data();
  float* hf = h_final->typed_data<float>();
  float* cp = checkpoint_data(*ckpt);
  parallel_for(N * s.H, (s.B * s.T / N) * kv * 4, [&](int64_t task) {
    const int64_t n = task / s.H, hd = task % s.H;
    float* h = hf + (n * s.H + hd) * kv;
    std::memcpy(h, h0.typed_data<float>() + (n * s.H + hd) * kv, sizeof(float) * kv);
    const int64_t start = seg[n], end = seg[n + 1];
    with_value_size(s.V, [&]<int VC>() {
      forward_sequence<T, VC>(in, u.typed_data<float>() + hd * s.K, ptr<T>(*o), h,
                              cp ? cp + (first_slot(n, start) * s.H + hd) * kv : nullptr, s.H * kv, start, end,
                              hd, scale, d);
    });
  });
  return ffi::Error::Success();
}

// Backward of one (sequence, head): G holds dL/dh_final on entry and dL/dh_0 on return.
template <typename T, int VC>
void backward_sequence(const T* const in[4], const float* u, const T* d_o, T* const grads[4],
                       float* G, float* g_u, const float* slots, int64_t slot_stride,
                       int64_t start, int64_t end, int64_t hd, float scale, const Dims& d) {
  const int64_t H = d.H, K = d.K, V = VC ? VC : d.V, kv = K * V;
  std::vector<float> states(kChunk * kv), dv(V), d_out(V), g_r(K), g_k(K), g_w(K);
  Token x(d);
  const int64_t n_chunks = (end - start + kChunk - 1) / kChunk;
  for (int64_t c = n_chunks - 1; c >= 0; --c) {
    const int64_t c0 = start + c * kChunk, c1 = std::min(c0 + kChunk, end);
    std::memcpy(states.data(), slots + c * slot_stride, sizeof(float) * kv);
    for (int64_t g = c0; g + 1 < c1; ++g) {
      const int64_t i = g - c0;
      x.load_at(in, g, hd, d, scale);
      std::memcpy(states.data() + (i + 1) * kv, states.data() + i * kv, sizeof(float) * kv);
      step<VC>(x, u, states.data() + (i + 1) * kv, nullptr, d);
    }
    for (int64_t g = c1 - 1; g >= c0; --g) {
      x.load_at(in, g, hd, d, scale);
      load(d_o + (g * H + hd) * V, d_out.data(), V);
      step_back<VC>(x, u, states.data() + (g - c0) * kv, d_out.data(), G, g_r.data(), g_k.data(),
                    dv.data(), g_w.data(), g_u, scale, d);
      const int64_t ok = (g * H + hd) * K;
      store(g_r.data(), grads[0] + ok, K);
      store(g_k.data(), grads[1] + ok, K);
      store(dv.data(), grads[2] + (g * H + hd) * V, V);
      store(g_w.data(), grads[3] + ok, K);
    }
  }
}

template <typename T>
ffi::Error backward(const ffi::AnyBuffer* ins, ffi::AnyBuffer u_buf, ffi::AnyBuffer d_o,
                    ffi::AnyBuffer dh_final, ffi::AnyBuffer ckpt, ffi::Buffer<ffi::S32> cu,
                    float scale, ffi::Result<ffi::AnyBuffer>* grads, ffi::Result<ffi::AnyBuffer> du,
                    ffi::Result<ffi::AnyBuffer> dh0) {
  const Shapes s = shapes_of(ins);
  const int64_t H = s.H, K = s.K, V = s.V, N = cu.dimensions()[0] - 1, kv = K * V;
  const Dims d{H, K, V};
  const T* in[4];
  T* gr[4];
  for (int i = 0; i < 4; ++i) {
    in[i] = ptr<T>(ins[i]);
    gr[i] = ptr<T>(*grads[i]);
  }
  const int32_t* seg = cu.typed_data();
  parallel_for(N * H, (s.B * s.T / N) * kv * 12, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H;
    const int64_t start = seg[n], end = seg[n + 1];
    const float* u = u_buf.typed_data<float>() + hd * K;
    float* G = dh0->typed_data<float>() + (n * H + hd) * kv;  // dL/dh_t, walked back to dL/dh_0
    std::memcpy(G, dh_final.typed_data<float>() + (n * H + hd) * kv, sizeof(float) * kv);
    float* g_u = du->typed_data<float>() + (n * H + hd) * K;
    std::fill(g_u, g_u + K, 0.f);
    with_value_size(V, [&]<int VC>() {
      backward_sequence<T, VC>(in, u, ptr<T>(d_o), gr, G, g_u,
                               ckpt.typed_data<float>() + (first_slot(n, start) * H + hd) * kv,
                               H * kv, start, end, hd, scale, d);
    });
  });
  return ffi::Error::Success();
}

template <typename T>
ffi::Error step_pool(const ffi::AnyBuffer* ins, ffi::AnyBuffer u, ffi::Buffer<ffi::S32> rows,
                     float scale, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> pool) {
  const Shapes s = shapes_of(ins);
  const Dims d{s.H, s.K, s.V};
  const T* in[4];
  for (int i = 0; i < 4; ++i) in[i] = ptr<T>(ins[i]);
  const int64_t kv = s.K * s.V;
  const int64_t slots = pool->dimensions()[0];
  parallel_for(s.B * s.H, s.T * kv * 4, [&](int64_t task) {
    const int64_t n = task / s.H, hd = task % s.H;
    float* h = pool_row(pool->typed_data<float>(), rows.typed_data(), slots, n, hd, s.H, kv,
                        ptr<T>(*o), s.T, s.V);
    if (!h) return;
    with_value_size(s.V, [&]<int VC>() {
      forward_sequence<T, VC>(in, u.typed_data<float>() + hd * s.K, ptr<T>(*o), h, nullptr, 0,
                              n * s.T, (n + 1) * s.T, hd, scale, d);
    });
  });
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Rwkv6ForwardCpu(ffi::AnyBuffer r, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer w,
                           ffi::AnyBuffer u, ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu,
                           float scale, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::AnyBuffer> h_final, ffi::Result<ffi::AnyBuffer> ckpt) {
  const ffi::AnyBuffer ins[4] = {r, k, v, w};
  SeqShape s;
  Checks c = check_rwkv6(ins, u, s);
  if (c.ok()) check_forward(c, h0, cu, *o, *h_final, *ckpt, r.element_type(), s);
  check_cpu(c, s, cu);
  if (!c.ok()) return c.error("rwkv6 forward");
  return dispatch_float(r.element_type(), "rwkv6 forward", [&]<typename T>() {
    return forward<T>(ins, u, h0, cu, scale, o, h_final, ckpt);
  });
}

ffi::Error Rwkv6BackwardCpu(ffi::AnyBuffer r, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer w, ffi::AnyBuffer u, ffi::AnyBuffer d_o,
                            ffi::AnyBuffer dh_final, ffi::AnyBuffer ckpt,
                            ffi::Buffer<ffi::S32> cu, float scale, ffi::Result<ffi::AnyBuffer> dr,
                            ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                            ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> du,
                            ffi::Result<ffi::AnyBuffer> dh0) {
  const ffi::AnyBuffer ins[4] = {r, k, v, w};
  ffi::Result<ffi::AnyBuffer> grads[4] = {dr, dk, dv, dw};
  const ffi::AnyBuffer grad_bufs[4] = {*dr, *dk, *dv, *dw};
  SeqShape s;
  Checks c = check_rwkv6(ins, u, s);
  if (c.ok()) check_backward(c, d_o, dh_final, ckpt, cu, grad_bufs, 4, 2, *dh0, r.element_type(), s);
  if (c.ok()) check_f32(c, "du", *du, {s.N, s.H, s.K});
  check_cpu(c, s, cu);
  if (!c.ok()) return c.error("rwkv6 backward");
  return dispatch_float(r.element_type(), "rwkv6 backward", [&]<typename T>() {
    return backward<T>(ins, u, d_o, dh_final, ckpt, cu, scale, grads, du, dh0);
  });
}

ffi::Error Rwkv6StepCpu(ffi::AnyBuffer r, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer w,
                        ffi::AnyBuffer u, ffi::AnyBuffer pool_in, ffi::Buffer<ffi::S32> rows,
                        float scale, ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> pool) {
  const ffi::AnyBuffer ins[4] = {r, k, v, w};
  SeqShape s;
  Checks c = check_rwkv6(ins, u, s);
  if (c.ok()) check_step(c, pool_in, rows, *o, *pool, r.element_type(), s);
  check_cpu_rows(c, s);
  if (!c.ok()) return c.error("rwkv6_step");
  return dispatch_float(r.element_type(), "rwkv6_step", [&]<typename T>() {
    return step_pool<T>(ins, u, rows, scale, o, pool);
  });
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6ForwardCpu, Rwkv6ForwardCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV6_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6BackwardCpu, Rwkv6BackwardCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV6_BWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6StepCpu, Rwkv6StepCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV6_STEP_OPS);
