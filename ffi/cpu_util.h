// CPU helpers: element types, a small parallel-for and vector loops the compiler vectorises.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "checks.h"
#include "common.h"

namespace rwkv_ffi {

// bfloat16 as raw bits: float -> bf16 rounds to nearest even, like XLA's convert.
struct bf16 {
  uint16_t bits;
};
inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline _Float16 from_float<_Float16>(float x) { return static_cast<_Float16>(x); }
template <> inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// The data of an AnyBuffer as T (typed_data<T> accepts only XLA's own native types).
template <typename T> inline T* ptr(const ffi::AnyBuffer& b) { return static_cast<T*>(b.untyped_data()); }

template <typename T> inline void load(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}
template <typename T> inline void store(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// y += alpha * x
inline void axpy(float* __restrict y, float alpha, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}
inline float dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

// exp(x) in a form the compiler vectorises (libm's expf is a call per element): x = n ln2 + f,
// |f| <= ln2 / 2, e^f by its Taylor series to degree 7 (truncation < 1e-8 relative). 2^n is
// applied as two normal halves, so that e^x overflows to inf past float's range as expf does
// (x = +inf included: no clamp that would make a positive log decay's overflow finite).
inline float vexp(float x) {
  const float xc = std::min(std::max(x, -87.0f), 89.0f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float f = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t m = static_cast<int32_t>(n), half = m / 2;  // m in [-126, 128]
  const int32_t bits_a = (half + 127) << 23, bits_b = (m - half + 127) << 23;
  float scale_a, scale_b;
  std::memcpy(&scale_a, &bits_a, 4);
  std::memcpy(&scale_b, &bits_b, 4);
  const float y = p * scale_a * scale_b;
  return x < -87.0f ? 0.f : (x == x ? y : x);
}
inline void vexp_inplace(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = vexp(x[i]);
}

// Largest value size V of the CPU kernels (per-step vectors of V floats live on the stack).
constexpr int64_t kMaxValueSize = 1024;

// Calls body.template operator()<VC>() with VC = V for the common value sizes (the compiler
// unrolls and keeps the rows in registers), else VC = 0 (loops over the run-time V).
template <typename Body> auto with_value_size(int64_t V, Body&& body) {
  switch (V) {
    case 64: return body.template operator()<64>();
    case 128: return body.template operator()<128>();
    default: return body.template operator()<0>();
  }
}

// Worker threads: RWKV_JAX_FFI_THREADS if set, else the hardware's.
inline int64_t max_threads() {
  if (const char* env = std::getenv("RWKV_JAX_FFI_THREADS")) {
    int64_t n = std::atoll(env);
    if (n > 0) return n;
  }
  return std::max<unsigned>(1, std::thread::hardware_concurrency());
}

// Runs fn(task) for task in [0, n_tasks) on up to max_threads() threads. `work_per_task` (rough
// flops) keeps tiny calls (a decode step) on the calling thread, where a thread start would cost
// more than the work.
template <typename Fn> void parallel_for(int64_t n_tasks, int64_t work_per_task, Fn&& fn) {
  constexpr int64_t kMinWorkPerThread = 1 << 18;
  int64_t threads = std::min(max_threads(), n_tasks);
  threads = std::min(threads, std::max<int64_t>(1, n_tasks * work_per_task / kMinWorkPerThread));
  if (threads <= 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t t; (t = next.fetch_add(1)) < n_tasks;) fn(t);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

// Calls body.template operator()<T>() with T the C++ element type of `dtype`.
template <typename Body> ffi::Error dispatch_float(ffi::DataType dtype, const char* op, Body&& body) {
  switch (dtype) {
    case ffi::DataType::F32: return body.template operator()<float>();
    case ffi::DataType::BF16: return body.template operator()<bf16>();
    case ffi::DataType::F16: return body.template operator()<_Float16>();
    default:
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": inputs must be float32, bfloat16 or float16");
  }
}

// Checks the CPU kernels add to checks.h: V fits their stack vectors, and the values of
// cu_seqlens (read here on the host): offsets from 0 to B * T that never decrease, so every
// output token belongs to one sequence. Bad offsets are an error, never an out-of-bounds access
// or an unwritten output.
inline void check_cpu(Checks& c, const SeqShape& s, ffi::Buffer<ffi::S32> cu) {
  if (!c.ok()) return;
  c.require(s.V <= kMaxValueSize, "the CPU kernels support V <= " + std::to_string(kMaxValueSize));
  const int32_t* seg = cu.typed_data();
  const int64_t total = s.B * s.T;
  c.require(seg[0] == 0 && seg[s.N] == total,
            "cu_seqlens must start at 0 and end at " + std::to_string(total) + ", got " +
                std::to_string(seg[0]) + " ... " + std::to_string(seg[s.N]));
  for (int64_t i = 0; c.ok() && i < s.N; ++i)
    c.require(seg[i] <= seg[i + 1],
              "cu_seqlens must never decrease, got cu_seqlens[" + std::to_string(i) + ":" +
                  std::to_string(i + 2) + "] = " + std::to_string(seg[i]) + ", " +
                  std::to_string(seg[i + 1]));
}

// The step kernels' check. A state index outside the pool's s.N slots is no error: that row is
// skipped (the ops layer sends invalid rows there, see pool_row).
inline void check_cpu_rows(Checks& c, const SeqShape& s) {
  if (!c.ok()) return;
  c.require(s.V <= kMaxValueSize, "the CPU kernels support V <= " + std::to_string(kMaxValueSize));
}

// The pool slot of step row n, or null when its index is outside the pool's `slots` slots: then
// the row's outputs o[(t * H + hd) * V + j], t in [n T, (n + 1) T), are set to NaN and no slot is
// read or written.
template <typename T>
inline float* pool_row(float* pool, const int32_t* rows, int64_t slots, int64_t n, int64_t hd,
                       int64_t H, int64_t kv, T* o, int64_t length, int64_t V) {
  const int64_t row = rows[n];
  if (row >= 0 && row < slots) return pool + (row * H + hd) * kv;
  for (int64_t t = n * length; t < (n + 1) * length; ++t)
    std::fill_n(o + (t * H + hd) * V, V, from_float<T>(NAN));
  return nullptr;
}

}  // namespace rwkv_ffi
