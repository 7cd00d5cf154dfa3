// Runs the sequential RWKV-7 and RWKV-6 CUDA kernels (ffi/cuda_rwkv7.cuh, ffi/cuda_rwkv6.cuh, the
// GPU's own source) on the host through the stand-ins of this folder.
//   sequential_driver OP MODE K V DTYPE DIR B T H N SCALE
// OP: rwkv7 (inputs r w k v a b) or rwkv6 (r k v w, and float32 u [H, K]); DTYPE (f32, bf16,
// f16) is the kernels' input type, inputs are rounded to it. All files are float32 in DIR:
// inputs [B, T, H, K] (v and do: V).
//   MODE train: N sequences given by int32 cu [N + 1], initial state h0 and its cotangent dh
//     [N, H, K, V], cotangent do; forward with checkpoints, then backward. Writes out_o, out_h,
//     out_dh0, out_d<input> (and out_du [N, H, K] for rwkv6).
//   MODE step: B rows of T tokens on a pool [N, H, K, V] at int32 rows [B] (a row outside
//     [0, N) is the ops layer's invalid row). Writes out_o and out_pool.
#include "driver.h"

namespace rwkv_ffi {
namespace {
alignas(128) float sm[64 * 1024];  // the kernels' `extern __shared__ float sm[]`
}  // namespace
}  // namespace rwkv_ffi

#include "cuda_rwkv6.cuh"
#include "cuda_rwkv7.cuh"

using namespace rwkv_ffi;

namespace {

struct Problem {
  std::string op, mode, dir;
  int K, V, B, T, H, N;
  float scale;
  size_t size(char name) const { return size_t(B) * T * H * (name == 'v' ? V : K); }
  size_t states() const { return size_t(N) * H * K * V; }
  int64_t total() const { return int64_t(B) * T; }
};

// A kernel's arrays by input name, each with its problem's size.
template <typename T> struct Arrays {
  std::string names;
  std::vector<std::vector<T>> data;
  T* operator()(char name) { return data[names.find(name)].data(); }
};
template <typename T> Arrays<T> read_inputs(const Problem& q, const std::string& names) {
  Arrays<T> x{names, {}};
  for (char n : names) x.data.push_back(read_as<T>(q.dir + "/" + n, q.size(n)));
  return x;
}
// NaN everywhere, so that an element a kernel leaves unwritten shows in the results.
template <typename T> std::vector<T> unwritten(size_t n) {
  return std::vector<T>(n, from_f<T>(NAN));
}
template <typename T> Arrays<T> unwritten(const Problem& q, const std::string& names) {
  Arrays<T> x{names, {}};
  for (char n : names) x.data.push_back(unwritten<T>(q.size(n)));
  return x;
}

// The grid (H, n) of V-thread blocks, as the .cu launches.
template <typename Kernel, typename Args>
void run_sequential(Kernel kernel, const Args& p, const Problem& q, int64_t n, size_t shared) {
  run_grid(kernel, p, q.H, unsigned(n), q.V, shared, (char*)sm, sizeof(sm));
}

template <int K, typename T> struct Rwkv7 {
  static constexpr const char* names = "rwkvab";
  static void forward(const Problem& q, Arrays<T>& x, const float*, ForwardArgs base, int64_t n) {
    Rwkv7Args p{base, x('r'), x('w'), x('k'), x('v'), x('a'), x('b')};
    run_sequential(rwkv7_forward_kernel<K, T>, p, q, n, rwkv7_forward_shared_bytes<K>(q.V));
  }
  static void backward(const Problem& q, Arrays<T>& x, const T* d_o, const float*, Arrays<T>& g,
                       float*, BackwardArgs base) {
    Rwkv7BackArgs p{base, x('r'), x('w'), x('k'), x('v'), x('a'), x('b'), d_o,
                    g('r'), g('w'), g('k'), g('v'), g('a'), g('b')};
    run_sequential(rwkv7_backward_kernel<K, T>, p, q, q.N, rwkv7_backward_shared_bytes<K>(q.V));
  }
};

template <int K, typename T> struct Rwkv6 {
  static constexpr const char* names = "rkvw";
  static void forward(const Problem& q, Arrays<T>& x, const float* u, ForwardArgs base, int64_t n) {
    Rwkv6Args p{base, x('r'), x('k'), x('v'), x('w'), u};
    run_sequential(rwkv6_forward_kernel<K, T>, p, q, n, rwkv6_forward_shared_bytes<K>(q.V));
  }
  static void backward(const Problem& q, Arrays<T>& x, const T* d_o, const float* u, Arrays<T>& g,
                       float* du, BackwardArgs base) {
    Rwkv6BackArgs p{base, x('r'), x('k'), x('v'), x('w'), d_o, u,
                    g('r'), g('k'), g('v'), g('w'), du};
    run_sequential(rwkv6_backward_kernel<K, T>, p, q, q.N, rwkv6_backward_shared_bytes<K>(q.V));
  }
};

template <typename Op, typename T> int run(const Problem& q) {
  auto x = read_inputs<T>(q, Op::names);
  std::vector<float> u = q.op == "rwkv6" ? read_raw<float>(q.dir + "/u", size_t(q.H) * q.K)
                                         : std::vector<float>();
  if (q.mode == "step") {
    std::vector<T> o(q.size('v'));  // zeros: an invalid row's NaN must come from the kernel
    auto pool = read_raw<float>(q.dir + "/pool", q.states());
    auto rows = read_raw<int>(q.dir + "/rows", q.B);
    Op::forward(q, x, u.data(),
                {nullptr, rows.data(), q.N, pool.data(), pool.data(), nullptr, o.data(), q.H, q.V,
                 q.T, q.total(), q.scale},
                q.B);
    write_from(q.dir + "/out_o", o.data(), o.size());
    write_from(q.dir + "/out_pool", pool.data(), pool.size());
    return 0;
  }
  auto cu = read_raw<int>(q.dir + "/cu", q.N + 1);
  auto h0 = read_raw<float>(q.dir + "/h0", q.states());
  auto dh = read_raw<float>(q.dir + "/dh", q.states());
  auto d_o = read_as<T>(q.dir + "/do", q.size('v'));
  auto ckpt = unwritten<float>(checkpoint_slots(q.N, q.total()) * q.H * q.K * q.V);
  auto h = unwritten<float>(q.states()), dh0 = unwritten<float>(q.states());
  auto du = unwritten<float>(size_t(q.N) * q.H * q.K);
  auto o = unwritten<T>(q.size('v'));
  Op::forward(q, x, u.data(),
              {cu.data(), nullptr, 0, h0.data(), h.data(), ckpt.data(), o.data(), q.H, q.V, q.T,
               q.total(), q.scale},
              q.N);
  auto g = unwritten<T>(q, Op::names);
  Op::backward(q, x, d_o.data(), u.data(), g, du.data(),
               {cu.data(), dh.data(), ckpt.data(), dh0.data(), q.H, q.V, q.total(), q.scale});
  write_from(q.dir + "/out_o", o.data(), o.size());
  write_from(q.dir + "/out_h", h.data(), h.size());
  write_from(q.dir + "/out_dh0", dh0.data(), dh0.size());
  for (char n : std::string(Op::names))
    write_from(q.dir + "/out_d" + n, g(n), q.size(n));
  if (q.op == "rwkv6") write_from(q.dir + "/out_du", du.data(), du.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 12) {
    fprintf(stderr, "usage: %s OP MODE K V DTYPE DIR B T H N SCALE\n", argv[0]);
    return 2;
  }
  const Problem q{argv[1], argv[2], argv[6], atoi(argv[3]), atoi(argv[4]), atoi(argv[7]),
                  atoi(argv[8]), atoi(argv[9]), atoi(argv[10]), float(atof(argv[11]))};
  if ((q.op != "rwkv7" && q.op != "rwkv6") || (q.mode != "train" && q.mode != "step")) return 2;
  if (q.V % 32 || q.V < 32 || q.V > 1024) return 2;
  return dispatch_head_size_and_dtype(q.K, argv[5], [&](auto k, auto t) {
    constexpr int K = decltype(k)::value;
    using T = decltype(t);
    return q.op == "rwkv7" ? run<Rwkv7<K, T>, T>(q) : run<Rwkv6<K, T>, T>(q);
  });
}
