// Shape and dtype checks of the FFI handlers, shared by the CPU and CUDA handlers. A failed check
// becomes an InvalidArgument error: the kernels never run on shapes they do not expect.
#pragma once

#include <string>

#include "common.h"

namespace rwkv_ffi {

using Buffers = const ffi::AnyBuffer*;

// Sizes of a sequence op: per-token inputs [B, T, H, K] (v: [B, T, H, V]), N state rows.
struct SeqShape {
  int64_t B = 0, T = 0, H = 0, K = 0, V = 0, N = 0;
};

// The per-token inputs ins[0..count): one float dtype, [B, T, H, K], except ins[v_index] [.., V].
inline Checks check_tokens(Buffers ins, int count, const char* const* names, int v_index,
                           SeqShape& s) {
  Checks c;
  auto d0 = ins[0].dimensions();
  c.require(d0.size() == 4, std::string(names[0]) + " must be 4-D [B, T, H, K], got " + dims_str(d0));
  c.require(ins[v_index].dimensions().size() == 4, "v must be 4-D [B, T, H, V]");
  if (!c.ok()) return c;
  s = SeqShape{d0[0], d0[1], d0[2], d0[3], ins[v_index].dimensions()[3], 0};
  c.require(is_float_input(ins[0].element_type()),
            "inputs must be float32, bfloat16 or float16");
  for (int i = 0; i < count; ++i) {
    c.shape(names[i], ins[i].dimensions(), {s.B, s.T, s.H, i == v_index ? s.V : s.K});
    c.require(ins[i].element_type() == ins[0].element_type(),
              std::string(names[i]) + " must have the dtype of " + names[0]);
  }
  return c;
}

inline void check_f32(Checks& c, const char* name, ffi::AnyBuffer x,
                      std::initializer_list<int64_t> dims) {
  c.shape(name, x.dimensions(), dims);
  c.require(x.element_type() == ffi::DataType::F32, std::string(name) + " must be float32");
}

// The chunked RWKV-7 kernels' checkpoints: bfloat16 for 16-bit inputs (their backward reads the
// saved state as a bfloat16 operand), float32 for float32 inputs. Every other kernel's: float32.
inline ffi::DataType chunk_checkpoint_dtype(ffi::DataType inputs) {
  return inputs == ffi::DataType::F32 ? ffi::DataType::F32 : ffi::DataType::BF16;
}

inline void check_checkpoints(Checks& c, ffi::AnyBuffer ckpt, std::initializer_list<int64_t> dims,
                              ffi::DataType dtype) {
  c.shape("checkpoints", ckpt.dimensions(), dims);
  c.require(ckpt.element_type() == dtype,
            std::string("checkpoints must be ") +
                (dtype == ffi::DataType::F32 ? "float32" : "bfloat16"));
}

inline void check_segments_shape(Checks& c, ffi::Buffer<ffi::S32> cu, SeqShape& s) {
  c.require(cu.dimensions().size() == 1 && cu.dimensions()[0] >= 2,
            "cu_seqlens must be [N + 1] with N >= 1");
  if (c.ok()) s.N = cu.dimensions()[0] - 1;
}

// Training forward: initial state [N, H, K, V] -> o, final state, checkpoints.
inline void check_forward(Checks& c, ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu,
                          ffi::AnyBuffer o, ffi::AnyBuffer h_final, ffi::AnyBuffer ckpt,
                          ffi::DataType dtype, SeqShape& s,
                          ffi::DataType ckpt_dtype = ffi::DataType::F32) {
  check_segments_shape(c, cu, s);
  if (!c.ok()) return;
  check_f32(c, "initial state", h0, {s.N, s.H, s.K, s.V});
  c.shape("o", o.dimensions(), {s.B, s.T, s.H, s.V});
  c.require(o.element_type() == dtype, "o must have the inputs' dtype");
  check_f32(c, "final state", h_final, {s.N, s.H, s.K, s.V});
  // Zero checkpoint rows: a forward without a backward saves none.
  const bool none = ckpt.dimensions().size() == 4 && ckpt.dimensions()[0] == 0;
  check_checkpoints(c, ckpt, {none ? 0 : checkpoint_slots(s.N, s.B * s.T), s.H, s.K, s.V},
                    ckpt_dtype);
}

// The checkpoints of a forward, or null when it saves none.
template <typename T = float> T* checkpoint_data(ffi::AnyBuffer ckpt) {
  return ckpt.dimensions()[0] == 0 ? nullptr : static_cast<T*>(ckpt.untyped_data());
}

// Training backward: d_o, d(final state), checkpoints -> per-token gradients, d(initial state).
inline void check_backward(Checks& c, ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final,
                           ffi::AnyBuffer ckpt, ffi::Buffer<ffi::S32> cu, Buffers grads,
                           int count, int v_index, ffi::AnyBuffer dh0, ffi::DataType dtype,
                           SeqShape& s, ffi::DataType ckpt_dtype = ffi::DataType::F32) {
  check_segments_shape(c, cu, s);
  if (!c.ok()) return;
  c.shape("d_o", d_o.dimensions(), {s.B, s.T, s.H, s.V});
  c.require(d_o.element_type() == dtype, "d_o must have the inputs' dtype");
  check_f32(c, "final state cotangent", dh_final, {s.N, s.H, s.K, s.V});
  check_checkpoints(c, ckpt, {checkpoint_slots(s.N, s.B * s.T), s.H, s.K, s.V}, ckpt_dtype);
  check_f32(c, "initial state gradient", dh0, {s.N, s.H, s.K, s.V});
  for (int i = 0; i < count; ++i) {
    c.shape("gradient", grads[i].dimensions(), {s.B, s.T, s.H, i == v_index ? s.V : s.K});
    c.require(grads[i].element_type() == dtype, "gradients must have the inputs' dtype");
  }
}

// Inference step: a float32 pool [S, H, K, V] aliased to the output, state_indices [B].
inline void check_step(Checks& c, ffi::AnyBuffer pool_in, ffi::Buffer<ffi::S32> rows,
                       ffi::AnyBuffer o, ffi::AnyBuffer pool, ffi::DataType dtype, SeqShape& s) {
  check_f32(c, "state", pool_in, {-1, s.H, s.K, s.V});
  c.shape("state_indices", rows.dimensions(), {s.B});
  c.shape("o", o.dimensions(), {s.B, s.T, s.H, s.V});
  c.require(o.element_type() == dtype, "o must have the inputs' dtype");
  c.require(pool.untyped_data() == pool_in.untyped_data(),
            "the state output must alias the state input (in-place update)");
  if (c.ok()) s.N = pool_in.dimensions()[0];  // pool slots
}

inline Checks check_rwkv7(Buffers ins, SeqShape& s) {
  static const char* const names[6] = {"r", "w", "k", "v", "a", "b"};
  return check_tokens(ins, 6, names, 3, s);
}

// An rwkv7 training forward's and backward's checks (each platform's own come after); CHUNKED:
// the chunked kernels', whose checkpoints have chunk_checkpoint_dtype.
inline Checks check_rwkv7_forward(Buffers ins, ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu,
                                  ffi::AnyBuffer o, ffi::AnyBuffer h_final, ffi::AnyBuffer ckpt,
                                  SeqShape& s, bool chunked = false) {
  Checks c = check_rwkv7(ins, s);
  const ffi::DataType dtype = ins[0].element_type();
  if (c.ok())
    check_forward(c, h0, cu, o, h_final, ckpt, dtype, s,
                  chunked ? chunk_checkpoint_dtype(dtype) : ffi::DataType::F32);
  return c;
}
inline Checks check_rwkv7_backward(Buffers ins, ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final,
                                   ffi::AnyBuffer ckpt, ffi::Buffer<ffi::S32> cu, Buffers grads,
                                   ffi::AnyBuffer dh0, SeqShape& s, bool chunked = false) {
  Checks c = check_rwkv7(ins, s);
  const ffi::DataType dtype = ins[0].element_type();
  if (c.ok())
    check_backward(c, d_o, dh_final, ckpt, cu, grads, 6, 3, dh0, dtype, s,
                   chunked ? chunk_checkpoint_dtype(dtype) : ffi::DataType::F32);
  return c;
}

inline Checks check_rwkv6(Buffers ins, ffi::AnyBuffer u, SeqShape& s) {
  static const char* const names[4] = {"r", "k", "v", "w"};
  Checks c = check_tokens(ins, 4, names, 2, s);
  if (c.ok()) check_f32(c, "u", u, {s.H, s.K});
  return c;
}

// RWKV-4: k, v [B, T, C] of one float dtype, w and u float32 [C].
struct Rwkv4Shape {
  int64_t B = 0, T = 0, C = 0, chunks = 0;
};

inline Checks check_rwkv4(ffi::AnyBuffer w, ffi::AnyBuffer u, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          Rwkv4Shape& s) {
  Checks c;
  auto d = k.dimensions();
  c.require(d.size() == 3, "k must be 3-D [B, T, C], got " + dims_str(d));
  if (!c.ok()) return c;
  s = Rwkv4Shape{d[0], d[1], d[2], (d[1] + kChunk - 1) / kChunk};
  c.require(is_float_input(k.element_type()), "k and v must be float32, bfloat16 or float16");
  c.shape("v", v.dimensions(), {s.B, s.T, s.C});
  c.require(v.element_type() == k.element_type(), "v must have the dtype of k");
  check_f32(c, "w", w, {s.C});
  check_f32(c, "u", u, {s.C});
  return c;
}

inline void check_rwkv4_forward(Checks& c, ffi::AnyBuffer s0, ffi::AnyBuffer y,
                                ffi::AnyBuffer s_final, ffi::AnyBuffer ckpt, ffi::DataType dtype,
                                const Rwkv4Shape& s) {
  check_f32(c, "initial state", s0, {s.B, s.C, 3});
  c.shape("y", y.dimensions(), {s.B, s.T, s.C});
  c.require(y.element_type() == dtype, "y must have the dtype of k");
  check_f32(c, "final state", s_final, {s.B, s.C, 3});
  check_f32(c, "checkpoints", ckpt, {s.B, s.chunks, s.C, 3});
}

inline void check_rwkv4_backward(Checks& c, ffi::AnyBuffer dy, ffi::AnyBuffer ds_final,
                                 ffi::AnyBuffer ckpt, ffi::AnyBuffer dw, ffi::AnyBuffer du,
                                 ffi::AnyBuffer dk, ffi::AnyBuffer dv, ffi::AnyBuffer ds0,
                                 ffi::DataType dtype, const Rwkv4Shape& s) {
  c.shape("dy", dy.dimensions(), {s.B, s.T, s.C});
  c.require(dy.element_type() == dtype, "dy must have the dtype of k");
  check_f32(c, "final state cotangent", ds_final, {s.B, s.C, 3});
  check_f32(c, "checkpoints", ckpt, {s.B, s.chunks, s.C, 3});
  check_f32(c, "dw", dw, {s.B, s.C});
  check_f32(c, "du", du, {s.B, s.C});
  c.shape("dk", dk.dimensions(), {s.B, s.T, s.C});
  c.shape("dv", dv.dimensions(), {s.B, s.T, s.C});
  c.require(dk.element_type() == dtype && dv.element_type() == dtype,
            "dk and dv must have the dtype of k");
  check_f32(c, "initial state gradient", ds0, {s.B, s.C, 3});
}

}  // namespace rwkv_ffi
