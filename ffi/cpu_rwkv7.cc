// RWKV-7 (generalized delta rule) on the CPU: training forward/backward and the inference step.
//
//   h_t = diag(exp(w_t)) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T,   o_t = h_t^T (scale r_t)
//
// One task per (sequence, head); the K x V state (key-major rows of V floats) stays in a
// per-task buffer. The backward walks the chunks in reverse: it recomputes the states of a chunk
// from its checkpoint, then runs the exact reverse recurrence
//   dh_{t-1} = diag(exp(w_t)) dh_t + a_t (b_t^T dh_t).
#include "checks.h"
#include "cpu_util.h"
#include "handlers.h"

namespace rwkv_ffi {
namespace {

struct Dims {
  int64_t H, K, V;
};

// One token's inputs for one head, as float; ew = exp(w), rs = scale * r.
struct Token {
  std::vector<float> rs, ew, k, a, b, v;
  Token(const Dims& d) : rs(d.K), ew(d.K), k(d.K), a(d.K), b(d.K), v(d.V) {}
  template <typename T>
  void load_at(const T* const in[6], int64_t g, int64_t h, const Dims& d, float scale) {
    const int64_t ok = (g * d.H + h) * d.K, ov = (g * d.H + h) * d.V;
    load(in[0] + ok, rs.data(), d.K);
    load(in[1] + ok, ew.data(), d.K);
    load(in[2] + ok, k.data(), d.K);
    load(in[3] + ov, v.data(), d.V);
    load(in[4] + ok, a.data(), d.K);
    load(in[5] + ok, b.data(), d.K);
    for (int64_t i = 0; i < d.K; ++i) rs[i] *= scale;
    vexp_inplace(ew.data(), d.K);
  }
};

// sa = a^T hp; hn = diag(ew) hp + b sa^T + k v^T (hn may alias hp); out = hn^T rs if out.
// VC: the value size when known at compile time (then the loops unroll and the V-vectors stay in
// registers), else 0.
template <int VC>
void step(const Token& x, const float* hp, float* hn, float* sa, float* out, const Dims& d) {
  const int64_t K = d.K, V = VC ? VC : d.V;
  alignas(64) float s[VC ? VC : kMaxValueSize], o[VC ? VC : kMaxValueSize];
  std::fill(s, s + V, 0.f);
  std::fill(o, o + V, 0.f);
  for (int64_t i = 0; i < K; ++i) {
    const float ai = x.a[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) s[j] += ai * hp[i * V + j];
  }
  const float* v = x.v.data();
  for (int64_t i = 0; i < K; ++i) {
    const float e = x.ew[i], bi = x.b[i], ki = x.k[i], ri = x.rs[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      const float n = hp[i * V + j] * e + bi * s[j] + ki * v[j];
      hn[i * V + j] = n;
      o[j] += ri * n;
    }
  }
  std::copy(s, s + V, sa);
  if (out) std::copy(o, o + V, out);
}

// Reverse of one step from hp = h_{t-1} and sa = a^T h_{t-1}: G holds dL/dh_t (without o_t's
// read) on entry and dL/dh_{t-1} on return; writes the gradients of this step's inputs.
template <int VC>
void step_back(const Token& x, const float* hp, const float* sa, const float* d_out, float* G,
               float* g_r, float* g_w, float* g_k, float* g_v, float* g_a, float* g_b,
               float scale, const Dims& d) {
  const int64_t K = d.K, V = VC ? VC : d.V;
  alignas(64) float dsa[VC ? VC : kMaxValueSize], dv[VC ? VC : kMaxValueSize];
  std::fill(dsa, dsa + V, 0.f);
  std::fill(dv, dv + V, 0.f);
  const float* v = x.v.data();
  float sa_do = 0.f, v_do = 0.f;
#pragma omp simd reduction(+ : sa_do, v_do)
  for (int64_t j = 0; j < V; ++j) {
    sa_do += sa[j] * d_out[j];
    v_do += v[j] * d_out[j];
  }
  // dh_t = G + rs do^T (the read of o_t); dsa = dh_t^T b; dv = dh_t^T k.
  for (int64_t i = 0; i < K; ++i) {
    const float ri = x.rs[i], bi = x.b[i], ki = x.k[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      const float g = G[i * V + j] + ri * d_out[j];
      G[i * V + j] = g;
      dsa[j] += bi * g;
      dv[j] += ki * g;
    }
  }
  for (int64_t i = 0; i < K; ++i) {
    const float* h = hp + i * V;
    float* g = G + i * V;
    const float e = x.ew[i], ai = x.a[i];
    float h_do = 0.f, g_h = 0.f, g_v = 0.f, g_sa = 0.f, h_dsa = 0.f;
#pragma omp simd reduction(+ : h_do, g_h, g_v, g_sa, h_dsa)
    for (int64_t j = 0; j < V; ++j) {
      const float gj = g[j];
      h_do += h[j] * d_out[j];
      g_h += gj * h[j];
      g_v += gj * v[j];
      g_sa += gj * sa[j];
      h_dsa += h[j] * dsa[j];
      g[j] = e * gj + ai * dsa[j];  // dh_{t-1} = diag(ew) dh_t + a (b^T dh_t)
    }
    // o_t reads h_t = ew h_{t-1} + b sa^T + k v^T.
    g_r[i] = scale * (e * h_do + x.b[i] * sa_do + x.k[i] * v_do);
    g_w[i] = e * g_h;
    g_k[i] = g_v;
    g_b[i] = g_sa;
    g_a[i] = h_dsa;
  }
  std::copy(dv, dv + V, g_v);
}

// The forward's step, one pass over the state: h = diag(ew) h + b sa^T + k v^T in place,
// out = h^T rs, and already sa_next = a_next^T h for the next step (when a_next is given).
template <int VC>
void step_in_place(const Token& x, const float* a_next, float* h, const float* sa,
                   float* sa_next, float* out, const Dims& d) {
  const int64_t K = d.K, V = VC ? VC : d.V;
  alignas(64) float s[VC ? VC : kMaxValueSize], o[VC ? VC : kMaxValueSize];
  std::fill(s, s + V, 0.f);
  std::fill(o, o + V, 0.f);
  const float* v = x.v.data();
  for (int64_t i = 0; i < K; ++i) {
    const float e = x.ew[i], bi = x.b[i], ki = x.k[i], ri = x.rs[i];
    const float an = a_next ? a_next[i] : 0.f;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      const float n = h[i * V + j] * e + bi * sa[j] + ki * v[j];
      h[i * V + j] = n;
      o[j] += ri * n;
      s[j] += an * n;
    }
  }
  std::copy(s, s + V, sa_next);
  std::copy(o, o + V, out);
}

// Runs tokens [start, end) of one head from the state in `h` (updated in place), writing o and,
// if ckpt, the state before every kChunk-th step into consecutive slots (stride slot_stride).
template <typename T, int VC>
void forward_sequence(const T* const in[6], T* o, float* h, float* ckpt, int64_t slot_stride,
                      int64_t start, int64_t end, int64_t hd, float scale, const Dims& d) {
  if (start >= end) return;
  Token x(d), next(d);
  std::vector<float> sa(d.V), sa_next(d.V), out(d.V);
  x.load_at(in, start, hd, d, scale);
  std::fill(sa.begin(), sa.end(), 0.f);
  for (int64_t i = 0; i < d.K; ++i) axpy(sa.data(), x.a[i], h + i * d.V, d.V);
  for (int64_t g = start; g < end; ++g) {
    if (ckpt && (g - start) % kChunk == 0)
      std::memcpy(ckpt + ((g - start) / kChunk) * slot_stride, h, sizeof(float) * d.K * d.V);
    const bool more = g + 1 < end;
    if (more) next.load_at(in, g + 1, hd, d, scale);
    step_in_place<VC>(x, more ? next.a.data() : nullptr, h, sa.data(), sa_next.data(),
                      out.data(), d);
    store(out.data(), o + (g * d.H + hd) * d.V, d.V);
    std::swap(x, next);
    std::swap(sa, sa_next);
  }
}

template <typename T>
ffi::Error forward(const ffi::AnyBuffer* ins, ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu,
                   float scale, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> h_final,
                   ffi::Result<ffi::AnyBuffer> ckpt) {
  auto dims = ins[0].dimensions();
  const int64_t B = dims[0], T_ = dims[1], H = dims[2], K = dims[3], V = ins[3].dimensions()[3];
  const int64_t N = cu.dimensions()[0] - 1;
  const Dims d{H, K, V};
  const T* in[6];
  for (int i = 0; i < 6; ++i) in[i] = ptr<T>(ins[i]);
  const int32_t* seg = cu.typed_data();
  const float* h0p = h0.typed_data<float>();
  float* hf = h_final->typed_data<float>();
  float* cp = checkpoint_data(*ckpt);
  T* op = ptr<T>(*o);
  const int64_t kv = K * V;
  parallel_for(N * H, (B * T_ / N) * kv * 5, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H;
    float* h = hf + (n * H + hd) * kv;
    std::memcpy(h, h0p + (n * H + hd) * kv, sizeof(float) * kv);
    const int64_t start = seg[n], end = seg[n + 1];
    with_value_size(V, [&]<int VC>() {
      forward_sequence<T, VC>(in, op, h, cp ? cp + (first_slot(n, start) * H + hd) * kv : nullptr, H * kv, start,
                              end, hd, scale, d);
    });
  });
  return ffi::Error::Success();
}

// Backward of one (sequence, head): G holds dL/dh_final on entry and dL/dh_0 on return.
template <typename T, int VC>
void backward_sequence(const T* const in[6], const T* d_o, T* const grads[6], float* G,
                       const float* slots, int64_t slot_stride, int64_t start, int64_t end,
                       int64_t hd, float scale, const Dims& d) {
  const int64_t H = d.H, K = d.K, V = VC ? VC : d.V, kv = K * V;
  // states[i]: the state before step i of the chunk (one extra slot: the last step's successor).
  std::vector<float> states((kChunk + 1) * kv), sas(kChunk * V), dv(V), d_out(V);
  std::vector<float> g_r(K), g_w(K), g_k(K), g_a(K), g_b(K);
  Token x(d);
  const int64_t n_chunks = (end - start + kChunk - 1) / kChunk;
  for (int64_t c = n_chunks - 1; c >= 0; --c) {
    const int64_t c0 = start + c * kChunk, c1 = std::min(c0 + kChunk, end);
    std::memcpy(states.data(), slots + c * slot_stride, sizeof(float) * kv);
    for (int64_t g = c0; g < c1; ++g) {
      const int64_t i = g - c0;
      x.load_at(in, g, hd, d, scale);
      step<VC>(x, states.data() + i * kv, states.data() + (i + 1) * kv, sas.data() + i * V,
               nullptr, d);
    }
    for (int64_t g = c1 - 1; g >= c0; --g) {
      const int64_t i = g - c0;
      x.load_at(in, g, hd, d, scale);
      load(d_o + (g * H + hd) * V, d_out.data(), V);
      step_back<VC>(x, states.data() + i * kv, sas.data() + i * V, d_out.data(), G, g_r.data(),
                    g_w.data(), g_k.data(), dv.data(), g_a.data(), g_b.data(), scale, d);
      const int64_t ok = (g * H + hd) * K;
      store(g_r.data(), grads[0] + ok, K);
      store(g_w.data(), grads[1] + ok, K);
      store(g_k.data(), grads[2] + ok, K);
      store(dv.data(), grads[3] + (g * H + hd) * V, V);
      store(g_a.data(), grads[4] + ok, K);
      store(g_b.data(), grads[5] + ok, K);
    }
  }
}

template <typename T>
ffi::Error backward(const ffi::AnyBuffer* ins, ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final,
                    ffi::AnyBuffer ckpt, ffi::Buffer<ffi::S32> cu, float scale,
                    ffi::Result<ffi::AnyBuffer>* grads, ffi::Result<ffi::AnyBuffer> dh0) {
  auto dims = ins[0].dimensions();
  const int64_t B = dims[0], T_ = dims[1], H = dims[2], K = dims[3], V = ins[3].dimensions()[3];
  const int64_t N = cu.dimensions()[0] - 1, kv = K * V;
  const Dims d{H, K, V};
  const T* in[6];
  T* gr[6];
  for (int i = 0; i < 6; ++i) {
    in[i] = ptr<T>(ins[i]);
    gr[i] = ptr<T>(*grads[i]);
  }
  const int32_t* seg = cu.typed_data();
  parallel_for(N * H, (B * T_ / N) * kv * 20, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H;
    const int64_t start = seg[n], end = seg[n + 1];
    float* G = dh0->typed_data<float>() + (n * H + hd) * kv;
    std::memcpy(G, dh_final.typed_data<float>() + (n * H + hd) * kv, sizeof(float) * kv);
    const float* slots = ckpt.typed_data<float>() + (first_slot(n, start) * H + hd) * kv;
    with_value_size(V, [&]<int VC>() {
      backward_sequence<T, VC>(in, ptr<T>(d_o), gr, G, slots, H * kv, start, end, hd,
                               scale, d);
    });
  });
  return ffi::Error::Success();
}

template <typename T>
ffi::Error step_pool(const ffi::AnyBuffer* ins, ffi::Buffer<ffi::S32> rows, float scale,
                     ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> pool) {
  auto dims = ins[0].dimensions();
  const int64_t B = dims[0], T_ = dims[1], H = dims[2], K = dims[3], V = ins[3].dimensions()[3];
  const Dims d{H, K, V};
  const T* in[6];
  for (int i = 0; i < 6; ++i) in[i] = ptr<T>(ins[i]);
  const int32_t* idx = rows.typed_data();
  float* state = pool->typed_data<float>();
  T* op = ptr<T>(*o);
  const int64_t kv = K * V;
  const int64_t slots = pool->dimensions()[0];
  parallel_for(B * H, T_ * kv * 5, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H;
    float* h = pool_row(state, idx, slots, n, hd, H, kv, op, T_, V);
    if (!h) return;
    with_value_size(V, [&]<int VC>() {
      forward_sequence<T, VC>(in, op, h, nullptr, 0, n * T_, (n + 1) * T_, hd, scale, d);
    });
  });
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Rwkv7ForwardCpu(ffi::AnyBuffer r, ffi::AnyBuffer w, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer h0,
                           ffi::Buffer<ffi::S32> cu, float scale, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::AnyBuffer> h_final, ffi::Result<ffi::AnyBuffer> ckpt) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  SeqShape s;
  Checks c = check_rwkv7_forward(ins, h0, cu, *o, *h_final, *ckpt, s);
  check_cpu(c, s, cu);
  if (!c.ok()) return c.error("rwkv7 forward");
  return dispatch_float(r.element_type(), "rwkv7 forward", [&]<typename T>() {
    return forward<T>(ins, h0, cu, scale, o, h_final, ckpt);
  });
}

ffi::Error Rwkv7BackwardCpu(ffi::AnyBuffer r, ffi::AnyBuffer w, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer a, ffi::AnyBuffer b,
                            ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final, ffi::AnyBuffer ckpt,
                            ffi::Buffer<ffi::S32> cu, float scale, ffi::Result<ffi::AnyBuffer> dr,
                            ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> da,
                            ffi::Result<ffi::AnyBuffer> db, ffi::Result<ffi::AnyBuffer> dh0) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  ffi::Result<ffi::AnyBuffer> grads[6] = {dr, dw, dk, dv, da, db};
  const ffi::AnyBuffer grad_bufs[6] = {*dr, *dw, *dk, *dv, *da, *db};
  SeqShape s;
  Checks c = check_rwkv7_backward(ins, d_o, dh_final, ckpt, cu, grad_bufs, *dh0, s);
  check_cpu(c, s, cu);
  if (!c.ok()) return c.error("rwkv7 backward");
  return dispatch_float(r.element_type(), "rwkv7 backward", [&]<typename T>() {
    return backward<T>(ins, d_o, dh_final, ckpt, cu, scale, grads, dh0);
  });
}

ffi::Error Rwkv7StepCpu(ffi::AnyBuffer r, ffi::AnyBuffer w, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer pool_in,
                        ffi::Buffer<ffi::S32> rows, float scale, ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> pool) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  SeqShape s;
  Checks c = check_rwkv7(ins, s);
  if (c.ok()) check_step(c, pool_in, rows, *o, *pool, r.element_type(), s);
  check_cpu_rows(c, s);
  if (!c.ok()) return c.error("rwkv7_step");
  return dispatch_float(r.element_type(), "rwkv7_step", [&]<typename T>() {
    return step_pool<T>(ins, rows, scale, o, pool);
  });
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ForwardCpu, Rwkv7ForwardCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV7_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7BackwardCpu, Rwkv7BackwardCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV7_BWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7StepCpu, Rwkv7StepCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV7_STEP_OPS);
