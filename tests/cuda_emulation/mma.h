// A host stand-in for the nvcuda::wmma subset the chunked kernels use (bfloat16 operands at
// 16 x 16 x 16, TF32 ones read from float32 at 16 x 16 x 8, float operands, float32 sums): lane 0
// of each warp does the whole tile, the other lanes nothing.
#pragma once
#include <cstring>
#include "cuda_device.cuh"
namespace nvcuda { namespace wmma {
struct row_major {}; struct col_major {}; struct matrix_a {}; struct matrix_b {}; struct accumulator {};
namespace precision { struct tf32 {}; }
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
  static constexpr int num_elements = 256;
  float x[256];
};
inline bool lane0() { return threadIdx.x % 32 == 0; }
// Rounded to TF32 (10 mantissa bits), to nearest with ties away from zero, as cvt.rna.tf32.f32.
inline float __float_to_tf32(float v) {
  uint32_t u; std::memcpy(&u, &v, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) { u += 0x1000u; u &= 0xffffe000u; }
  std::memcpy(&v, &u, 4); return v;
}
template <int K, typename T, typename L, typename P>
void load_matrix_sync(fragment<matrix_a, 16, 16, K, T, L>& f, const P* p, unsigned ld) {
  if (!lane0()) return;
  for (int m = 0; m < 16; ++m) for (int k = 0; k < K; ++k)
    f.x[m * K + k] = rwkv_ffi::to_f(std::is_same<L, row_major>::value ? p[m * ld + k] : p[k * ld + m]);
}
template <int K, typename T, typename L, typename P>
void load_matrix_sync(fragment<matrix_b, 16, 16, K, T, L>& f, const P* p, unsigned ld) {
  if (!lane0()) return;
  for (int k = 0; k < K; ++k) for (int n = 0; n < 16; ++n)
    f.x[k * 16 + n] = rwkv_ffi::to_f(std::is_same<L, row_major>::value ? p[k * ld + n] : p[n * ld + k]);
}
template <int K>
void load_matrix_sync(fragment<accumulator, 16, 16, K, float>& f, const float* p, unsigned ld, layout_t) {
  if (!lane0()) return;
  for (int m = 0; m < 16; ++m) for (int n = 0; n < 16; ++n) f.x[m * 16 + n] = p[m * ld + n];
}
template <int K> void fill_fragment(fragment<accumulator, 16, 16, K, float>& f, float v) { for (auto& e : f.x) e = v; }
template <int K, typename TA, typename LA, typename TB, typename LB>
void mma_sync(fragment<accumulator, 16, 16, K, float>& d, const fragment<matrix_a, 16, 16, K, TA, LA>& a,
              const fragment<matrix_b, 16, 16, K, TB, LB>& b, const fragment<accumulator, 16, 16, K, float>& c) {
  if (!lane0()) return;
  float r[256];
  for (int m = 0; m < 16; ++m) for (int n = 0; n < 16; ++n) {
    float s = c.x[m * 16 + n];
    for (int k = 0; k < K; ++k) s += a.x[m * K + k] * b.x[k * 16 + n];
    r[m * 16 + n] = s;
  }
  for (int i = 0; i < 256; ++i) d.x[i] = r[i];
}
template <int K>
void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, K, float>& f, unsigned ld, layout_t) {
  if (!lane0()) return;
  for (int m = 0; m < 16; ++m) for (int n = 0; n < 16; ++n) p[m * ld + n] = f.x[m * 16 + n];
}
}}
