// `x @ w.T` for the few rows of a batched decode step, as an MLX primitive for the CPU.
//
// BLAS packs the whole weight matrix on every call whatever the row count, so eight rows cost
// three times one. Here each weight row is read from memory once, straight into registers, and
// multiplied by every row of x while it is there. Each output is one dot product summed in a
// fixed order, so a row's result does not depend on the other rows of the batch.
//
// x: [M, K] float32, w: [N, K] float32 (a Linear's weight), out: [M, N]. AVX-512 only.

#include <immintrin.h>
#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace {

constexpr int kPrefetch = 512;  // floats ahead of the weight rows being read

// out[m, r] = x[m, :] . w[r, :] for m < P, r < R.
template <int P, int R, bool kPrefetchW>
__attribute__((target("avx512f"))) inline void block(
    const float* x, const float* w, float* out, int K, int ldo) {
  __m512 acc[R][P];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) acc[r][m] = _mm512_setzero_ps();
  const int full = K & ~15;
  int k = 0;
  for (; k < full; k += 16) {
    __m512 u[R];
    for (int r = 0; r < R; r++) {
      u[r] = _mm512_loadu_ps(w + static_cast<size_t>(r) * K + k);
      if (kPrefetchW)
        _mm_prefetch(
            reinterpret_cast<const char*>(w + static_cast<size_t>(r) * K + k + kPrefetch),
            _MM_HINT_T0);
    }
    for (int m = 0; m < P; m++) {
      __m512 xv = _mm512_loadu_ps(x + static_cast<size_t>(m) * K + k);
      for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(u[r], xv, acc[r][m]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 u[R];
    for (int r = 0; r < R; r++) u[r] = _mm512_maskz_loadu_ps(tail, w + static_cast<size_t>(r) * K + k);
    for (int m = 0; m < P; m++) {
      __m512 xv = _mm512_maskz_loadu_ps(tail, x + static_cast<size_t>(m) * K + k);
      for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(u[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) out[static_cast<size_t>(m) * ldo + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Rows [0, M) of x against weight rows [0, R): passes of P rows of x, the first one prefetching.
template <int P, int R>
__attribute__((target("avx512f"))) void rows_against(
    const float* x, const float* w, float* out, int M, int K, int ldo) {
  int m = 0;
  for (bool first = true; m + P <= M; m += P, first = false) {
    const float* xs = x + static_cast<size_t>(m) * K;
    float* os = out + static_cast<size_t>(m) * ldo;
    if (first)
      block<P, R, true>(xs, w, os, K, ldo);
    else
      block<P, R, false>(xs, w, os, K, ldo);
  }
  const float* xs = x + static_cast<size_t>(m) * K;
  float* os = out + static_cast<size_t>(m) * ldo;
  switch (M - m) {  // fewer than P rows left
    case 0: break;
    case 1: block<1, R, false>(xs, w, os, K, ldo); break;
    case 2: block<2, R, false>(xs, w, os, K, ldo); break;
    case 3: block<3, R, false>(xs, w, os, K, ldo); break;
    case 4: block<4, R, false>(xs, w, os, K, ldo); break;
    case 5: block<5, R, false>(xs, w, os, K, ldo); break;
    case 6: block<6, R, false>(xs, w, os, K, ldo); break;
    default: block<7, R, false>(xs, w, os, K, ldo); break;
  }
}

// Weight rows [n0, n1) against every row of x. Rows of x go in passes that stay in L1 beside
// the weight block: 8 at a time for short rows (two weight rows a block), else 4 (four rows).
template <int P, int R>
__attribute__((target("avx512f"))) void weight_rows(
    const float* x, const float* w, float* out, int M, int N, int K, int n0, int n1) {
  int n = n0;
  for (; n + R <= n1; n += R)
    rows_against<P, R>(x, w + static_cast<size_t>(n) * K, out + n, M, K, N);
  for (; n < n1; n++) rows_against<P, 1>(x, w + static_cast<size_t>(n) * K, out + n, M, K, N);
}

void rows_matmul_range(const float* x, const float* w, float* out, int M, int N, int K, int n0, int n1) {
  if (K <= 768)
    weight_rows<8, 2>(x, w, out, M, N, K, n0, n1);
  else
    weight_rows<4, 4>(x, w, out, M, N, K, n0, n1);
}

// Threads for one call at a time. Between calls (a decode step makes hundreds, microseconds
// apart) they spin a little, yielding, and then sleep until the next call.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; i++) workers_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs task(0) here and task(i) on worker i; returns when all are done.
  void run(const std::function<void(int)>& task) {
    if (workers_.empty()) return task(0);
    task_ = &task;
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    task(0);
    while (pending_.load(std::memory_order_acquire) > 0) _mm_pause();
  }

 private:
  void loop(int index) {
    uint64_t seen = 0;
    while (true) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; generation_.load(std::memory_order_acquire) == seen; spins++) {
        _mm_pause();
        if (spins % 256 != 0) continue;
        if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(300)) {
          std::this_thread::yield();
          continue;
        }
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        sleeping_.fetch_sub(1);
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      (*task_)(index);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  const std::function<void(int)>* task_ = nullptr;
  bool stop_ = false;
};

// The threads of every product; set_threads replaces them between products.
std::mutex g_pool_mutex;
std::unique_ptr<Pool> g_pool;

void run_on_pool(const std::function<void(int)>& task, int* parts) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_unique<Pool>(1);
  *parts = g_pool->size();
  g_pool->run(task);
}

int set_threads(int threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  threads = std::max(1, threads);
  if (!g_pool || g_pool->size() != threads) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(threads);
  }
  return g_pool->size();
}

class RowsMatmul : public mx::Primitive {
 public:
  explicit RowsMatmul(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    const int M = x.shape(0), K = x.shape(1), N = w.shape(0);
    encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), op = out.data<float>(), M, N, K] {
      int parts = 1;  // set under the pool's lock, before any task runs
      const std::function<void(int)> task = [&](int i) {
        const int n0 = static_cast<int>(static_cast<int64_t>(N) * i / parts) & ~3;
        const int n1 = i + 1 == parts ? N : static_cast<int>(static_cast<int64_t>(N) * (i + 1) / parts) & ~3;
        rows_matmul_range(xp, wp, op, M, N, K, n0, n1);
      };
      run_on_pool(task, &parts);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("rows_matmul runs on the CPU only");
  }
  const char* name() const override { return "RowsMatmul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array rows_matmul(const mx::array& x, const mx::array& w) {
  if (x.ndim() != 2 || w.ndim() != 2 || x.shape(1) != w.shape(1))
    throw std::invalid_argument("rows_matmul: expected x [M, K] and w [N, K]");
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32)
    throw std::invalid_argument("rows_matmul: float32 only");
  if (!__builtin_cpu_supports("avx512f"))
    throw std::invalid_argument("rows_matmul: the CPU lacks AVX-512");
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(
      {x.shape(0), w.shape(0)}, mx::float32, std::make_shared<RowsMatmul>(s),
      {mx::contiguous(x, false, s), mx::contiguous(w, false, s)});
}

}  // namespace

NB_MODULE(_rows_matmul, m) {
  m.doc() = "x @ w.T for the few rows of a batched decode step, on the CPU";
  m.def("rows_matmul", &rows_matmul, "x"_a, "w"_a);
  m.def("set_threads", &set_threads, "threads"_a, "The threads of every later product.");
  m.def("supported", [] { return static_cast<bool>(__builtin_cpu_supports("avx512f")); });
}
