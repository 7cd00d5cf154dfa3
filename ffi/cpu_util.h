// CPU helpers: element types, a small parallel-for and vector loops the compiler vectorises.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

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
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
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

// Sequence bounds from cu_seqlens (validated here, on the host: bad offsets are an error, never an
// out-of-bounds access).
inline std::string check_segments(const int32_t* cu, int64_t n, int64_t total_tokens) {
  for (int64_t i = 0; i < n; ++i)
    if (cu[i] < 0 || cu[i + 1] < cu[i] || cu[i + 1] > total_tokens)
      return "cu_seqlens must be non-decreasing offsets in [0, " + std::to_string(total_tokens) +
             "], got cu_seqlens[" + std::to_string(i) + ":" + std::to_string(i + 2) + "] = " +
             std::to_string(cu[i]) + ", " + std::to_string(cu[i + 1]);
  return "";
}

}  // namespace rwkv_ffi
