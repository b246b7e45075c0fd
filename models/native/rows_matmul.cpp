// `x @ w.T` for the few rows of a batched decode step, as an MLX primitive for the CPU.
//
// BLAS packs the whole weight matrix on every call whatever the row count, so eight rows cost
// three times one. Here each weight row is read from memory once, straight into registers, and
// multiplied by every row of x while it is there. Each output is one dot product summed in a
// fixed order, so a row's result does not depend on the other rows of the batch.
//
// x: [M, K] float32, w: [N, K] float32 (a Linear's weight), out: [M, N]. AVX-512, or AVX2 with
// FMA, chosen at run time; each gives its own fixed bits.
//
// With LoRA (rows_matmul_lora): out = x @ w.T + ((x @ a_t.T) * mask) @ b_t.T, each row with its
// own scales in `mask` [M, R], in the same pass: the low-rank columns extend every dot product,
// so a batch of rows with different adapters costs one primitive per projection.

#include <immintrin.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
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

// One pair of operands of a sum of products: rows of x [M, k] and of w [N, k], row-major.
struct Seg {
  const float* x = nullptr;
  const float* w = nullptr;
  int k = 0;  // 0: no operands
  Seg rows(int m, int n) const {
    return k ? Seg{x + static_cast<size_t>(m) * k, w + static_cast<size_t>(n) * k, k} : *this;
  }
};

using Range = void (*)(const Seg&, const Seg&, float*, int, int, int, int);

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
struct Isa {  // 32 vector registers: up to 16 accumulators, the weight rows and one x row
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kShortK = 768, kShortP = 8, kShortR = 2, kLongP = 4, kLongR = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_first(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#include "rows_kernel.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
struct Isa {  // 16 vector registers: 8 accumulators
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kShortK = 4096, kShortP = 4, kShortR = 2, kLongP = 2, kLongR = 4;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_first(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#include "rows_kernel.h"
}  // namespace avx2
#pragma GCC pop_options

// The kernels, widest first, with what the CPU needs for each.
struct Kernel {
  const char* isa;
  bool (*supported)();
  Range range;
};
const Kernel kKernels[] = {
    {"avx512", [] { return static_cast<bool>(__builtin_cpu_supports("avx512f")); },
     avx512::rows_matmul_range},
    {"avx2",
     [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); },
     avx2::rows_matmul_range},
};

// The kernel named `isa` (nullptr: the widest this CPU runs); nullptr if the CPU lacks it.
const Kernel* find_kernel(const std::string& isa = "") {
  for (const auto& kernel : kKernels)
    if ((isa.empty() || isa == kernel.isa) && kernel.supported()) return &kernel;
  return nullptr;
}

const Kernel* const kWidest = find_kernel();
const char* g_isa = kWidest ? kWidest->isa : "none";
std::atomic<Range> g_kernel{kWidest ? kWidest->range : nullptr};

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

  // inputs: x, w; with LoRA also a_t [R, K], b_t [N, R], mask [M, R].
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    const int M = x.shape(0), K = x.shape(1), N = w.shape(0);
    const bool lora = inputs.size() == 5;
    const int R = lora ? inputs[2].shape(0) : 0;
    const float* ap = lora ? inputs[2].data<float>() : nullptr;
    const float* bp = lora ? inputs[3].data<float>() : nullptr;
    const float* maskp = lora ? inputs[4].data<float>() : nullptr;
    encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), op = out.data<float>(), M, N, K,
                      R, ap, bp, maskp, kernel = g_kernel.load()] {
      std::vector<float> h;  // [M, R]: each row's low-rank activations, times its scales
      Seg extra;
      if (R > 0) {
        h.resize(static_cast<size_t>(M) * R);
        kernel(Seg{xp, ap, K}, Seg{}, h.data(), M, R, 0, R);
        for (size_t i = 0; i < h.size(); i++) h[i] *= maskp[i];
        extra = Seg{h.data(), bp, R};
      }
      int parts = 1;  // set under the pool's lock, before any task runs
      const std::function<void(int)> task = [&](int i) {
        const int n0 = static_cast<int>(static_cast<int64_t>(N) * i / parts) & ~3;
        const int n1 =
            i + 1 == parts ? N : static_cast<int>(static_cast<int64_t>(N) * (i + 1) / parts) & ~3;
        kernel(Seg{xp, wp, K}, extra, op, M, N, n0, n1);
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

void check_float32(const std::vector<mx::array>& arrays) {
  for (const auto& a : arrays)
    if (a.ndim() != 2 || a.dtype() != mx::float32)
      throw std::invalid_argument("rows_matmul: float32 matrices only");
  if (g_kernel.load() == nullptr)
    throw std::invalid_argument("rows_matmul: the CPU lacks AVX2 and FMA");
}

mx::array rows_primitive(std::vector<mx::array> inputs) {
  const auto s = mx::default_stream(mx::Device::cpu);
  const mx::Shape shape = {inputs[0].shape(0), inputs[1].shape(0)};
  for (auto& input : inputs) input = mx::contiguous(input, false, s);
  return mx::array(shape, mx::float32, std::make_shared<RowsMatmul>(s), std::move(inputs));
}

mx::array rows_matmul(const mx::array& x, const mx::array& w) {
  check_float32({x, w});
  if (x.shape(1) != w.shape(1))
    throw std::invalid_argument("rows_matmul: expected x [M, K] and w [N, K]");
  return rows_primitive({x, w});
}

mx::array rows_matmul_lora(
    const mx::array& x, const mx::array& w, const mx::array& a_t, const mx::array& b_t,
    const mx::array& mask) {
  check_float32({x, w, a_t, b_t, mask});
  const auto M = x.shape(0), K = x.shape(1), N = w.shape(0), R = a_t.shape(0);
  if (w.shape(1) != K || a_t.shape(1) != K || b_t.shape(0) != N || b_t.shape(1) != R ||
      mask.shape(0) != M || mask.shape(1) != R)
    throw std::invalid_argument(
        "rows_matmul_lora: expected x [M, K], w [N, K], a_t [R, K], b_t [N, R], mask [M, R]");
  return rows_primitive({x, w, a_t, b_t, mask});
}

}  // namespace

NB_MODULE(_rows_matmul, m) {
  m.doc() = "x @ w.T for the few rows of a batched decode step, on the CPU";
  m.def("rows_matmul", &rows_matmul, "x"_a, "w"_a);
  m.def("rows_matmul_lora", &rows_matmul_lora, "x"_a, "w"_a, "a_t"_a, "b_t"_a, "mask"_a);
  m.def("set_threads", &set_threads, "threads"_a, "The threads of every later product.");
  m.def("isa", [] { return std::string(g_isa); }, "The vector instructions the kernel uses.");
  m.def(
      "use_isa",
      [](const std::string& name) {
        const Kernel* kernel = name.empty() ? nullptr : find_kernel(name);
        if (kernel == nullptr) return false;
        g_kernel = kernel->range, g_isa = kernel->isa;
        return true;
      },
      "name"_a, "Use the avx512 or avx2 kernel for later products; False if the CPU lacks it.");
}
