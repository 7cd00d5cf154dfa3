// Runs the chunked RWKV-7 CUDA kernels (ffi/cuda_rwkv7_chunk*.cuh, the GPU's own source) on the
// host through the stand-ins of this folder: forward with checkpoints, then backward.
//   rwkv7_chunk_driver D DTYPE DIR B T H N
// reads float32 files r w k v a b do ([B, T, H, D]), h0 dh ([N, H, D, D]) and int32 cu ([N + 1])
// from DIR and writes float32 files out_o, out_h, out_dh0 and out_d{r,w,k,v,a,b} there. DTYPE
// (f32, bf16, f16) is the kernels' input type; inputs are rounded to it.
#include "driver.h"

namespace rwkv_ffi {
namespace {
alignas(128) char sm[256 * 1024];  // the kernels' `extern __shared__ char sm[]`
}  // namespace
}  // namespace rwkv_ffi

#include "cuda_rwkv7_chunk_backward.cuh"
#include "cuda_rwkv7_chunk_forward.cuh"

using namespace rwkv_ffi;

namespace {

template <int D, typename Kernel> void run_chunked(Kernel kernel, const ChunkArgs& p, unsigned H,
                                                   unsigned N, size_t shared) {
  run_grid(kernel, p, H, N, kThreads<D>, shared, sm, sizeof(sm));
}

template <int D, typename T> int run(const std::string& dir, int B, int length, int H, int N) {
  const size_t tokens = size_t(B) * length * H * D, states = size_t(N) * H * D * D;
  const char* names[7] = {"r", "w", "k", "v", "a", "b", "do"};
  std::vector<std::vector<T>> in;
  for (int i = 0; i < 7; ++i) in.push_back(read_as<T>(dir + "/" + names[i], tokens));
  auto h0 = read_as<float>(dir + "/h0", states), dh = read_as<float>(dir + "/dh", states);
  auto cu = read_raw<int>(dir + "/cu", N + 1);
  const int64_t total = int64_t(B) * length;
  using Op = typename OperandOf<T>::type;  // the checkpoints' type
  std::vector<Op> ckpt(checkpoint_slots(N, total) * H * D * D);
  std::vector<float> h_final(states), dh0(states);
  std::vector<T> o(tokens);
  std::vector<std::vector<T>> g(6, std::vector<T>(tokens));
  const ChunkArgs forward{in[0].data(), in[1].data(), in[2].data(), in[3].data(), in[4].data(),
                          in[5].data(), nullptr, cu.data(), h0.data(), h_final.data(), ckpt.data(),
                          o.data(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, H, total,
                          1.0f};
  run_chunked<D>(rwkv7_chunk_forward_kernel<D, T>, forward, H, N, Layout<D, T, false>::bytes);
  const ChunkArgs backward{in[0].data(), in[1].data(), in[2].data(), in[3].data(), in[4].data(),
                           in[5].data(), in[6].data(), cu.data(), dh.data(), dh0.data(),
                           ckpt.data(), nullptr, g[0].data(), g[1].data(), g[2].data(),
                           g[3].data(), g[4].data(), g[5].data(), H, total, 1.0f};
  run_chunked<D>(rwkv7_chunk_backward_kernel<D, T>, backward, H, N, Layout<D, T, true>::bytes);
  write_from(dir + "/out_o", o.data(), tokens);
  write_from(dir + "/out_h", h_final.data(), states);
  write_from(dir + "/out_dh0", dh0.data(), states);
  for (int i = 0; i < 6; ++i) write_from(dir + "/out_d" + names[i], g[i].data(), tokens);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    fprintf(stderr, "usage: %s D DTYPE DIR B T H N\n", argv[0]);
    return 2;
  }
  const int D = atoi(argv[1]), B = atoi(argv[4]), T = atoi(argv[5]), H = atoi(argv[6]),
            N = atoi(argv[7]);
  return dispatch_head_size_and_dtype(D, argv[2], [&](auto k, auto t) {
    return run<decltype(k)::value, decltype(t)>(argv[3], B, T, H, N);
  });
}
