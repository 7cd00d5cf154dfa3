// A host stand-in for the nvcuda::wmma subset the chunked kernels use (bfloat16 or float operands,
// float32 sums, 16 x 16 x 16): lane 0 of each warp does the whole tile, the other lanes nothing.
#pragma once
#include "cuda_device.cuh"
namespace nvcuda { namespace wmma {
struct row_major {}; struct col_major {}; struct matrix_a {}; struct matrix_b {}; struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment { float x[256]; };
inline bool lane0() { return threadIdx.x % 32 == 0; }
template <typename T, typename L> void load_matrix_sync(fragment<matrix_a, 16, 16, 16, T, L>& f, const T* p, unsigned ld) {
  if (!lane0()) return;
  for (int m = 0; m < 16; ++m) for (int k = 0; k < 16; ++k)
    f.x[m * 16 + k] = rwkv_ffi::to_f(std::is_same<L, row_major>::value ? p[m * ld + k] : p[k * ld + m]);
}
template <typename T, typename L> void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, L>& f, const T* p, unsigned ld) {
  if (!lane0()) return;
  for (int k = 0; k < 16; ++k) for (int n = 0; n < 16; ++n)
    f.x[k * 16 + n] = rwkv_ffi::to_f(std::is_same<L, row_major>::value ? p[k * ld + n] : p[n * ld + k]);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ld, layout_t) {
  if (!lane0()) return;
  for (int m = 0; m < 16; ++m) for (int n = 0; n < 16; ++n) f.x[m * 16 + n] = p[m * ld + n];
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) { for (auto& e : f.x) e = v; }
template <typename A, typename B>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const A& a, const B& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  if (!lane0()) return;
  float r[256];
  for (int m = 0; m < 16; ++m) for (int n = 0; n < 16; ++n) {
    float s = c.x[m * 16 + n];
    for (int k = 0; k < 16; ++k) s += a.x[m * 16 + k] * b.x[k * 16 + n];
    r[m * 16 + n] = s;
  }
  for (int i = 0; i < 256; ++i) d.x[i] = r[i];
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ld, layout_t) {
  if (!lane0()) return;
  for (int m = 0; m < 16; ++m) for (int n = 0; n < 16; ++n) p[m * ld + n] = f.x[m * 16 + n];
}
}}
