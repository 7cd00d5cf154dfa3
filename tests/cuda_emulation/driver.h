// What the drivers of this folder share: float32 files in and out, converted to and from the
// kernels' element type, and a grid run on the host one block after another.
#pragma once
#include "cuda_host.h"
#include "cuda_device.cuh"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

// n 4-byte values (float32 or int32) of the file at `path`.
template <typename U> std::vector<U> read_raw(const std::string& path, size_t n) {
  static_assert(sizeof(U) == 4);
  std::vector<U> out(n);
  FILE* fp = fopen(path.c_str(), "rb");
  if (!fp || fread(out.data(), 4, n, fp) != n) {
    fprintf(stderr, "cannot read %zu values from %s\n", n, path.c_str());
    exit(1);
  }
  fclose(fp);
  return out;
}

// n float32 values of the file at `path`, rounded to T.
template <typename T> std::vector<T> read_as(const std::string& path, size_t n) {
  const auto f = read_raw<float>(path, n);
  std::vector<T> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = rwkv_ffi::from_f<T>(f[i]);
  return out;
}

template <typename T> void write_from(const std::string& path, const T* x, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = rwkv_ffi::to_f<T>(x[i]);
  FILE* fp = fopen(path.c_str(), "wb");
  if (!fp || fwrite(f.data(), 4, n, fp) != n) {
    fprintf(stderr, "cannot write %s\n", path.c_str());
    exit(1);
  }
  fclose(fp);
}

// The grid (H, N) of `threads`-thread blocks, one block after another, each as `threads` host
// threads; `shared` bytes of the kernels' shared memory `memory` (capacity bytes) in use.
template <typename Kernel, typename Args>
void run_grid(Kernel kernel, const Args& p, unsigned H, unsigned N, unsigned threads,
              size_t shared, char* memory, size_t capacity) {
  if (shared > capacity) {
    fprintf(stderr, "shared memory %zu > %zu\n", shared, capacity);
    exit(1);
  }
  gridDim = {H, N, 1};
  for (unsigned y = 0; y < N; ++y)
    for (unsigned x = 0; x < H; ++x) {
      std::fill(memory, memory + capacity, char(0x7f));  // no value survives from the last block
      std::barrier<> block(threads);
      std::vector<std::barrier<>*> warps;
      for (unsigned w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));
      emu_block_barrier = &block;
      for (unsigned w = 0; w < threads / 32; ++w) emu_warp_barrier[w] = warps[w];
      std::vector<std::thread> team;
      for (unsigned t = 0; t < threads; ++t)
        team.emplace_back([&, t] {
          threadIdx = {t, 1, 1};
          blockIdx = {x, y, 1};
          kernel(p);
        });
      for (auto& t : team) t.join();
      for (auto* w : warps) delete w;
    }
}

// body(std::integral_constant<int, K>{}, T{}) for the head size K (64 or 128) and the element
// type T of DTYPE (f32, bf16, f16), as the CUDA handlers dispatch; 2 (a usage error) otherwise.
template <typename Body>
int dispatch_head_size_and_dtype(int K, const std::string& dtype, Body body) {
  auto with_dtype = [&](auto k) {
    if (dtype == "f32") return body(k, float{});
    if (dtype == "bf16") return body(k, __nv_bfloat16{});
    if (dtype == "f16") return body(k, __half{});
    return 2;
  };
  if (K == 64) return with_dtype(std::integral_constant<int, 64>{});
  if (K == 128) return with_dtype(std::integral_constant<int, 128>{});
  return 2;
}
