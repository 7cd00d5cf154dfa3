// Shared by the CPU and CUDA kernels: the sequence layout, checkpoint slots and shape checks.
//
// Every sequence op sees its tokens flattened: inputs are [B, T, H, K] (or V), so token g of the
// flattened batch holds element (g, h, k) at (g * H + h) * K + k. Sequence n covers tokens
// [start, end): [n * T, (n + 1) * T) without cu_seqlens, [cu[n], cu[n + 1]) with them (then B == 1).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace rwkv_ffi {

namespace ffi = xla::ffi;

// The training kernels save the state every kChunk steps of each sequence; the backward
// recomputes the states inside a chunk from its checkpoint.
constexpr int64_t kChunk = 16;

#if defined(__CUDACC__)
#define RWKV_HD __host__ __device__ __forceinline__
#else
#define RWKV_HD inline
#endif

// Checkpoint slots: sequence n starting at flattened token `start` owns slots
// [n + start / kChunk, n + start / kChunk + ceil(len / kChunk)); these never overlap, and all
// fit in n_sequences + total_tokens / kChunk slots.
RWKV_HD int64_t first_slot(int64_t n, int64_t start) { return n + start / kChunk; }
inline int64_t checkpoint_slots(int64_t n_sequences, int64_t total_tokens) {
  return n_sequences + total_tokens / kChunk;
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks that `x` has rank `want.size()` and the given sizes (-1: any). Returns "" or a message.
inline std::string check_shape(const char* name, ffi::AnyBuffer::Dimensions dims,
                               std::initializer_list<int64_t> want) {
  bool ok = dims.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) {
    if (ok && w >= 0 && dims[i] != w) ok = false;
    ++i;
  }
  if (ok) return "";
  std::string expect = "[";
  i = 0;
  for (int64_t w : want) expect += (i++ ? ", " : "") + (w < 0 ? std::string("*") : std::to_string(w));
  return std::string(name) + " has shape " + dims_str(dims) + ", expected " + expect + "]";
}

// Collects the first failed check and turns it into an InvalidArgument error.
struct Checks {
  std::string message;
  void shape(const char* name, ffi::AnyBuffer::Dimensions dims, std::initializer_list<int64_t> want) {
    if (message.empty()) message = check_shape(name, dims, want);
  }
  void require(bool condition, const std::string& what) {
    if (message.empty() && !condition) message = what;
  }
  bool ok() const { return message.empty(); }
  ffi::Error error(const char* op) const {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
  }
};

inline bool is_float_input(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

}  // namespace rwkv_ffi
