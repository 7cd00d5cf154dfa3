// RWKV-7 (generalized delta rule) on the CPU: training forward/backward and the inference step.
//
//   h_t = diag(exp(w_t)) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T,   o_t = h_t^T (scale r_t)
//
// One task per (sequence, head); the K x V state (key-major rows of V floats) stays in a
// per-task buffer. The backward walks the chunks in reverse: it recomputes the states of a chunk
// from its checkpoint, then runs the exact reverse recurrence
//   dh_{t-1} = diag(exp(w_t)) dh_t + a_t (b_t^T dh_t).
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
    for (int64_t i = 0; i < d.K; ++i) {
      rs[i] *= scale;
      ew[i] = std::exp(ew[i]);
    }
  }
};

// sa = a^T hp; hn = diag(ew) hp + b sa^T + k v^T (hn may alias hp); out = hn^T rs if out.
void step(const Token& x, const float* hp, float* hn, float* sa, float* out, const Dims& d) {
  const int64_t K = d.K, V = d.V;
  std::fill(sa, sa + V, 0.f);
  for (int64_t i = 0; i < K; ++i) axpy(sa, x.a[i], hp + i * V, V);
  if (out) std::fill(out, out + V, 0.f);
  for (int64_t i = 0; i < K; ++i) {
    const float* __restrict p = hp + i * V;
    float* __restrict n = hn + i * V;
    const float e = x.ew[i], bi = x.b[i], ki = x.k[i];
    const float* __restrict s = sa;
    const float* __restrict v = x.v.data();
    for (int64_t j = 0; j < V; ++j) n[j] = p[j] * e + bi * s[j] + ki * v[j];
    if (out) axpy(out, x.rs[i], n, V);
  }
}

// Runs tokens [start, end) of one head from the state in `h` (updated in place), writing o and,
// if ckpt, the state before every kChunk-th step into consecutive slots (stride slot_stride).
template <typename T>
void forward_sequence(const T* const in[6], T* o, float* h, float* ckpt, int64_t slot_stride,
                      int64_t start, int64_t end, int64_t hd, float scale, const Dims& d) {
  Token x(d);
  std::vector<float> sa(d.V), out(d.V);
  for (int64_t g = start; g < end; ++g) {
    if (ckpt && (g - start) % kChunk == 0)
      std::memcpy(ckpt + ((g - start) / kChunk) * slot_stride, h, sizeof(float) * d.K * d.V);
    x.load_at(in, g, hd, d, scale);
    step(x, h, h, sa.data(), out.data(), d);
    store(out.data(), o + (g * d.H + hd) * d.V, d.V);
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
  for (int i = 0; i < 6; ++i) in[i] = ins[i].typed_data<T>();
  const int32_t* seg = cu.typed_data();
  const float* h0p = h0.typed_data<float>();
  float* hf = h_final->typed_data<float>();
  float* cp = ckpt->typed_data<float>();
  T* op = o->typed_data<T>();
  const int64_t kv = K * V;
  parallel_for(N * H, (B * T_ / std::max<int64_t>(N, 1)) * kv * 5, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H;
    float* h = hf + (n * H + hd) * kv;
    std::memcpy(h, h0p + (n * H + hd) * kv, sizeof(float) * kv);
    const int64_t start = seg[n], end = seg[n + 1];
    forward_sequence(in, op, h, cp + (first_slot(n, start) * H + hd) * kv, H * kv, start, end, hd,
                     scale, d);
  });
  return ffi::Error::Success();
}

template <typename T>
ffi::Error backward(const ffi::AnyBuffer* ins, ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final,
                    ffi::AnyBuffer ckpt, ffi::Buffer<ffi::S32> cu, float scale,
                    ffi::Result<ffi::AnyBuffer>* grads, ffi::Result<ffi::AnyBuffer> dh0) {
  auto dims = ins[0].dimensions();
  const int64_t B = dims[0], T_ = dims[1], H = dims[2], K = dims[3], V = ins[3].dimensions()[3];
  const int64_t N = cu.dimensions()[0] - 1;
  const Dims d{H, K, V};
  const T* in[6];
  T* gr[6];
  for (int i = 0; i < 6; ++i) {
    in[i] = ins[i].typed_data<T>();
    gr[i] = grads[i]->typed_data<T>();
  }
  const T* dop = d_o.typed_data<T>();
  const int32_t* seg = cu.typed_data();
  const float* cp = ckpt.typed_data<float>();
  const float* dhf = dh_final.typed_data<float>();
  float* dh0p = dh0->typed_data<float>();
  const int64_t kv = K * V;
  parallel_for(N * H, (B * T_ / std::max<int64_t>(N, 1)) * kv * 20, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H;
    const int64_t start = seg[n], end = seg[n + 1];
    float* G = dh0p + (n * H + hd) * kv;  // dL/dh_t, walked back to dL/dh_0 in place
    std::memcpy(G, dhf + (n * H + hd) * kv, sizeof(float) * kv);
    std::vector<float> states(kChunk * kv), sas(kChunk * V), dsa(V), dv(V), d_out(V);
    std::vector<float> g_r(K), g_w(K), g_k(K), g_a(K), g_b(K);
    Token x(d);
    const float* slots = cp + (first_slot(n, start) * H + hd) * kv;
    const int64_t n_chunks = (end - start + kChunk - 1) / kChunk;
    for (int64_t c = n_chunks - 1; c >= 0; --c) {
      const int64_t c0 = start + c * kChunk, c1 = std::min(c0 + kChunk, end);
      // States before each step of the chunk, and a^T h_{t-1} of each step.
      std::memcpy(states.data(), slots + c * H * kv, sizeof(float) * kv);
      for (int64_t g = c0; g < c1; ++g) {
        const int64_t i = g - c0;
        x.load_at(in, g, hd, d, scale);
        float* next = (g + 1 < c1) ? states.data() + (i + 1) * kv : nullptr;
        if (next) {
          step(x, states.data() + i * kv, next, sas.data() + i * V, nullptr, d);
        } else {
          std::fill(sas.begin() + i * V, sas.begin() + (i + 1) * V, 0.f);
          for (int64_t r = 0; r < K; ++r) axpy(sas.data() + i * V, x.a[r], states.data() + i * kv + r * V, V);
        }
      }
      for (int64_t g = c1 - 1; g >= c0; --g) {
        const int64_t i = g - c0;
        const float* hp = states.data() + i * kv;
        const float* sa = sas.data() + i * V;
        x.load_at(in, g, hd, d, scale);
        load(dop + (g * H + hd) * V, d_out.data(), V);
        // dh_t = G + rs do^T: the read of o_t.
        for (int64_t r = 0; r < K; ++r) axpy(G + r * V, x.rs[r], d_out.data(), V);
        std::fill(dsa.begin(), dsa.end(), 0.f);
        std::fill(dv.begin(), dv.end(), 0.f);
        for (int64_t r = 0; r < K; ++r) {
          axpy(dsa.data(), x.b[r], G + r * V, V);
          axpy(dv.data(), x.k[r], G + r * V, V);
        }
        const float sa_do = dot(sa, d_out.data(), V), v_do = dot(x.v.data(), d_out.data(), V);
        for (int64_t r = 0; r < K; ++r) {
          const float* Gr = G + r * V;
          const float* hr = hp + r * V;
          const float h_do = dot(hr, d_out.data(), V);
          // o_t reads h_t = ew h_{t-1} + b sa^T + k v^T.
          g_r[r] = scale * (x.ew[r] * h_do + x.b[r] * sa_do + x.k[r] * v_do);
          g_w[r] = x.ew[r] * dot(Gr, hr, V);
          g_k[r] = dot(Gr, x.v.data(), V);
          g_b[r] = dot(Gr, sa, V);
          g_a[r] = dot(hr, dsa.data(), V);
          float* Gw = G + r * V;
          const float e = x.ew[r], ar = x.a[r];
          for (int64_t j = 0; j < V; ++j) Gw[j] = e * Gw[j] + ar * dsa[j];
        }
        const int64_t ok = (g * H + hd) * K;
        store(g_r.data(), gr[0] + ok, K);
        store(g_w.data(), gr[1] + ok, K);
        store(g_k.data(), gr[2] + ok, K);
        store(dv.data(), gr[3] + (g * H + hd) * V, V);
        store(g_a.data(), gr[4] + ok, K);
        store(g_b.data(), gr[5] + ok, K);
      }
    }
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
  for (int i = 0; i < 6; ++i) in[i] = ins[i].typed_data<T>();
  const int32_t* idx = rows.typed_data();
  float* state = pool->typed_data<float>();
  T* op = o->typed_data<T>();
  const int64_t kv = K * V;
  parallel_for(B * H, T_ * kv * 5, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H;
    forward_sequence(in, op, state + (idx[n] * H + hd) * kv, nullptr, 0, n * T_, (n + 1) * T_, hd,
                     scale, d);
  });
  return ffi::Error::Success();
}

// Shapes shared by the three handlers: r, w, k, a, b [B, T, H, K], v [B, T, H, V], one dtype.
Checks check_inputs(const ffi::AnyBuffer* ins) {
  Checks c;
  static const char* names[6] = {"r", "w", "k", "v", "a", "b"};
  auto d0 = ins[0].dimensions();
  c.require(d0.size() == 4, "r must be 4-D [B, T, H, K], got " + dims_str(d0));
  if (!c.ok()) return c;
  for (int i = 0; i < 6; ++i) {
    c.shape(names[i], ins[i].dimensions(), {d0[0], d0[1], d0[2], i == 3 ? -1 : d0[3]});
    c.require(ins[i].element_type() == ins[0].element_type(),
              std::string(names[i]) + " must have the dtype of r");
  }
  return c;
}

}  // namespace

ffi::Error Rwkv7ForwardCpu(ffi::AnyBuffer r, ffi::AnyBuffer w, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer h0,
                           ffi::Buffer<ffi::S32> cu, float scale, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::AnyBuffer> h_final, ffi::Result<ffi::AnyBuffer> ckpt) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  Checks c = check_inputs(ins);
  if (!c.ok()) return c.error("rwkv7 forward");
  const int64_t B = r.dimensions()[0], T = r.dimensions()[1], H = r.dimensions()[2];
  const int64_t K = r.dimensions()[3], V = v.dimensions()[3], N = cu.dimensions()[0] - 1;
  c.require(N >= 1, "cu_seqlens needs at least 2 entries");
  c.shape("h0", h0.dimensions(), {N, H, K, V});
  c.require(h0.element_type() == ffi::DataType::F32, "h0 must be float32");
  c.shape("o", o->dimensions(), {B, T, H, V});
  c.shape("h_final", h_final->dimensions(), {N, H, K, V});
  c.shape("checkpoints", ckpt->dimensions(), {checkpoint_slots(N, B * T), H, K, V});
  if (c.ok()) c.require(check_segments(cu.typed_data(), N, B * T).empty(),
                        check_segments(cu.typed_data(), N, B * T));
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
  Checks c = check_inputs(ins);
  if (!c.ok()) return c.error("rwkv7 backward");
  const int64_t B = r.dimensions()[0], T = r.dimensions()[1], H = r.dimensions()[2];
  const int64_t K = r.dimensions()[3], V = v.dimensions()[3], N = cu.dimensions()[0] - 1;
  c.require(N >= 1, "cu_seqlens needs at least 2 entries");
  c.shape("d_o", d_o.dimensions(), {B, T, H, V});
  c.require(d_o.element_type() == r.element_type(), "d_o must have the dtype of r");
  c.shape("dh_final", dh_final.dimensions(), {N, H, K, V});
  c.shape("checkpoints", ckpt.dimensions(), {checkpoint_slots(N, B * T), H, K, V});
  c.shape("dh0", dh0->dimensions(), {N, H, K, V});
  ffi::Result<ffi::AnyBuffer> grads[6] = {dr, dw, dk, dv, da, db};
  for (int i = 0; i < 6; ++i) c.shape("gradient", grads[i]->dimensions(), {B, T, H, i == 3 ? V : K});
  if (c.ok()) c.require(check_segments(cu.typed_data(), N, B * T).empty(),
                        check_segments(cu.typed_data(), N, B * T));
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
  Checks c = check_inputs(ins);
  if (!c.ok()) return c.error("rwkv7_step");
  const int64_t B = r.dimensions()[0], T = r.dimensions()[1], H = r.dimensions()[2];
  const int64_t K = r.dimensions()[3], V = v.dimensions()[3];
  const int64_t S = pool_in.dimensions().size() == 4 ? pool_in.dimensions()[0] : -1;
  c.shape("state", pool_in.dimensions(), {-1, H, K, V});
  c.shape("state_indices", rows.dimensions(), {B});
  c.shape("o", o->dimensions(), {B, T, H, V});
  c.require(pool->untyped_data() == pool_in.untyped_data(), "state output must alias the input");
  for (int64_t i = 0; c.ok() && i < B; ++i)
    c.require(rows.typed_data()[i] >= 0 && rows.typed_data()[i] < S,
              "state_indices[" + std::to_string(i) + "] = " + std::to_string(rows.typed_data()[i]) +
                  " is outside the pool of " + std::to_string(S) + " slots");
  if (!c.ok()) return c.error("rwkv7_step");
  return dispatch_float(r.element_type(), "rwkv7_step", [&]<typename T>() {
    return step_pool<T>(ins, rows, scale, o, pool);
  });
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ForwardCpu, Rwkv7ForwardCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7BackwardCpu, Rwkv7BackwardCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7StepCpu, Rwkv7StepCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
