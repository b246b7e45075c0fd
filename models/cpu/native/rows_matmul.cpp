// `x @ w.T` for the few rows of a batched decode step, as an MLX primitive for the CPU.
//
// BLAS packs the whole weight matrix on every call whatever the row count, so eight rows cost
// three times one. Here each weight row is read from memory once, straight into registers, and
// multiplied by every row of x while it is there. Each output is one dot product summed in a
// fixed order, so a row's result does not depend on the other rows of the batch.
//
// x: [..., K] float32 (M rows), w: [N, K] float32 (a Linear's weight), out: [..., N]. AVX-512
// (with VBMI's byte shuffles for 4-bit codes where the CPU has them), or AVX2 with FMA, chosen at
// run time on x86-64; NEON on AArch64. Each gives its own fixed bits.
//
// With LoRA (rows_matmul_lora): out = x @ w.T + ((x @ a_t.T) * mask) @ b_t.T, each row with its
// own scales in `mask` [..., R] (M rows), in the same pass: the low-rank columns extend every
// dot product, so a batch of rows with different adapters costs one primitive per projection.
//
// Packed quantized weights (quant_matmul) take LoRA in the gathered form (quant_matmul_gather):
// a batch's plan (RowPlan: its adapters' pairs as mounted, held, not copied, and each row's own
// adapters) and the number of the LoRA slot the product is.
//
// Built with ROWS_KERNELS_ONLY defined, this file is the vector kernels and their table alone,
// without MLX or nanobind: what tests/native/kernels_check.cpp checks on each ISA.

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#else
#error "the native kernels are written for x86-64 and AArch64"
#endif
#ifndef ROWS_KERNELS_ONLY
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef ROWS_KERNELS_ONLY
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/math.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;
#endif

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
using Attend = void (*)(const float*, int, int, const float*, int64_t, const float*, int64_t, int,
                        const bool*, int64_t, int, float*, float*);
using Softmax = void (*)(float*, int, int);

// Weights [N, K] quantized as MLX's affine mode: the packed words, and a scale and a bias a
// group of `group` values in their own dtype.
struct Quantized {
  const uint32_t* w = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
  int K = 0, bits = 4, group = 32;
  int dtype = 0;  // 0: float32, 1: float16, 2: bfloat16
};

using QuantRange = void (*)(const Quantized&, const float*, float*, int, int, int, int, float*,
                            int);
// The gathered LoRA's kernels, for float32 adapters and for float16 ones (T: uint16_t).
template <typename T>
using Residuals = void (*)(const float*, const T*, int, const int*, int, float*, int, int);
template <typename T>
using LowRank = void (*)(const float*, const T*, int, int, float, float*);

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,f16c")
namespace avx512 {
struct Isa {  // 32 vector registers: up to 24 accumulators, the weight rows and one x row
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kShortK = 768, kShortP = 8, kShortR = 2, kLongP = 4, kLongR = 4;
  static constexpr int kFusedR = 4;  // weight rows dequantized in registers at once
  // A prompt's rows against a dequantized tile: 24 accumulators, ten loads for 24 products.
  static constexpr int kTileP = 6, kTileR = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_first(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static V load_half(const uint16_t* p) {  // 16 float16 values, converted exactly
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V from_bytes(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
  static constexpr bool kTable4 = false;  // codes converted; avx512vbmi picks them instead
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // out[i] = sum(v[i]) for i < 16, the same bits: sum's tree of additions (lanes 8 apart,
  // then 4, 2, 1) taken for sixteen vectors at once, each step's additions in whole vectors.
  // Lane 4u + e of the result holds the source 4e + u, so the sources go in in that order.
  static void sums16(const V (&v)[16], float* out) {
    V a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) {  // units 0, 1 of a[j]: source 2j's lanes i + (i + 8)
      const V x = v[order(2 * j)], y = v[order(2 * j + 1)];
      a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee));
    }
    for (int j = 0; j < 4; j++)  // unit u of b[j]: source 4j + u's lanes i + (i + 4)
      b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                           _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xdd));
    for (int j = 0; j < 2; j++) {  // lanes i + (i + 2), two sources a unit
      const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
      c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                        _mm512_shuffle_ps(c[0], c[1], 0xdd)));
  }
  static constexpr int order(int lane) { return 4 * (lane % 4) + lane / 4; }
};
#include "rows_kernel.h"
#include "quant_kernel.h"
#include "gather_kernel.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vbmi,f16c")
namespace avx512vbmi {
struct Isa : avx512::Isa {  // AVX-512's, with 4-bit codes picked by VBMI's byte shifts
  // 4-bit values as picks from a vector of the sixteen (quant_kernel.h's dequantize32).
  static constexpr bool kTable4 = true;
  static V codes16() {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  // out[h][j] = table[value 16h + j] for the 32 values of 16 bytes (value 2i in byte i's low
  // half, 2i+1 in its high half): lane j takes bits [4j, 4j + 8) of the 8 bytes of its half
  // (vpmultishiftqb), and the permute reads only a lane's low four bits.
  static void lookup4(const uint8_t* bytes, V table, V (&out)[2]) {
    const __m512i at = _mm512_setr_epi64(0x0000000400000000, 0x0000000c00000008,
                                         0x0000001400000010, 0x0000001c00000018,
                                         0x0000002400000020, 0x0000002c00000028,
                                         0x0000003400000030, 0x0000003c00000038);
    for (int h = 0; h < 2; h++) {
      uint64_t eight;
      std::memcpy(&eight, bytes + 8 * h, sizeof eight);
      const __m512i codes = _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64(eight));
      out[h] = _mm512_permutexvar_ps(codes, table);
    }
  }
};
#include "rows_kernel.h"
#include "quant_kernel.h"
}  // namespace avx512vbmi
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct Isa {  // 16 vector registers: 8 accumulators
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kShortK = 4096, kShortP = 4, kShortR = 2, kLongP = 2, kLongR = 4;
  static constexpr int kFusedR = 2;
  static constexpr int kTileP = 4, kTileR = 2;  // a prompt's rows against a dequantized tile
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_first(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static V load_half(const uint16_t* p) {  // 8 float16 values, converted exactly
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V from_bytes(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
  static constexpr bool kTable4 = false;  // a permute picks from eight lanes, not sixteen
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static void sums16(const V (&v)[16], float* out) {
    for (int i = 0; i < 16; i++) out[i] = sum(v[i]);  // too few registers to gain by it
  }
};
#include "rows_kernel.h"
#include "quant_kernel.h"
#include "gather_kernel.h"
}  // namespace avx2
#pragma GCC pop_options
#endif  // __x86_64__

#if defined(__aarch64__)
// Every ARMv8-A CPU has NEON and the half-to-float conversion: no target to ask for, nothing to
// check at run time.
namespace neon {
struct Isa {  // 32 vector registers, as AVX-512 has: its register blocks, of 4 lanes
  using V = float32x4_t;
  static constexpr int kLanes = 4;
  static constexpr int kShortK = 768, kShortP = 8, kShortR = 2, kLongP = 4, kLongR = 4;
  static constexpr int kFusedR = 2;  // a chunk of 32 values is 8 vectors a weight row here
  static constexpr int kTileP = 6, kTileR = 4;  // a prompt's rows against a dequantized tile
  static V zero() { return vdupq_n_f32(0.0f); }
  static V load(const float* p) { return vld1q_f32(p); }
  static V load_first(const float* p, int n) {  // no masked load: the n floats, then zeros
    float lanes[kLanes] = {};
    std::memcpy(lanes, p, sizeof(float) * n);
    return vld1q_f32(lanes);
  }
  static V load_half(const uint16_t* p) {  // 4 float16 values, converted exactly
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static V set1(float a) { return vdupq_n_f32(a); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  static void store(float* p, V v) { vst1q_f32(p, v); }
  // (lane 0 + lane 1) + (lane 2 + lane 3), by pairwise additions as sums16 takes them.
  static float sum(V v) {
    const V pairs = vpaddq_f32(v, v);
    return vgetq_lane_f32(pairs, 0) + vgetq_lane_f32(pairs, 1);
  }
  // out[i] = sum(v[i]) for i < 16, the same bits: four vectors' pairs, then their pairs' sums.
  static void sums16(const V (&v)[16], float* out) {
    for (int i = 0; i < 16; i += 4)
      vst1q_f32(out + i, vpaddq_f32(vpaddq_f32(v[i], v[i + 1]), vpaddq_f32(v[i + 2], v[i + 3])));
  }
};
#include "rows_kernel.h"
#include "quant_kernel.h"
#include "gather_kernel.h"
}  // namespace neon
#endif  // __aarch64__

// The kernels, widest first, with what the CPU needs for each.
struct Kernel {
  const char* isa;
  bool (*supported)();
  Range range;
  Attend attend;
  Softmax softmax;
  QuantRange quant;
  Residuals<float> residuals;
  LowRank<float> low_rank;  // a row's activations of one adapter (gather_kernel.h)
  Residuals<uint16_t> residuals_half;
  LowRank<uint16_t> low_rank_half;
};
const Kernel kKernels[] = {
#if defined(__x86_64__)
    {"avx512vbmi",
     [] {
       return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vbmi") &&
              __builtin_cpu_supports("f16c");
     },
     avx512vbmi::rows_matmul_range, avx512vbmi::attend, avx512vbmi::softmax_rows,
     avx512vbmi::quant_matmul_range, avx512vbmi::add_residuals<float>,
     avx512::low_rank_row<float>, avx512vbmi::add_residuals<uint16_t>,
     avx512::low_rank_row<uint16_t>},  // its low-rank products are AVX-512's
    {"avx512",
     [] { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c"); },
     avx512::rows_matmul_range, avx512::attend, avx512::softmax_rows,
     avx512::quant_matmul_range, avx512::add_residuals<float>, avx512::low_rank_row<float>,
     avx512::add_residuals<uint16_t>, avx512::low_rank_row<uint16_t>},
    {"avx2",
     [] {
       return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
              __builtin_cpu_supports("f16c");
     },
     avx2::rows_matmul_range, avx2::attend, avx2::softmax_rows, avx2::quant_matmul_range,
     avx2::add_residuals<float>, avx2::low_rank_row<float>, avx2::add_residuals<uint16_t>,
     avx2::low_rank_row<uint16_t>},
#elif defined(__aarch64__)
    {"neon", [] { return true; }, neon::rows_matmul_range, neon::attend, neon::softmax_rows,
     neon::quant_matmul_range, neon::add_residuals<float>, neon::low_rank_row<float>,
     neon::add_residuals<uint16_t>, neon::low_rank_row<uint16_t>},
#endif
};

// The kernel named `isa` (nullptr: the widest this CPU runs); nullptr if the CPU lacks it.
const Kernel* find_kernel(const std::string& isa = "") {
  for (const auto& kernel : kKernels)
    if ((isa.empty() || isa == kernel.isa) && kernel.supported()) return &kernel;
  return nullptr;
}

#ifndef ROWS_KERNELS_ONLY
const Kernel* const kWidest = find_kernel();
const char* g_isa = kWidest ? kWidest->isa : "none";
std::atomic<Range> g_kernel{kWidest ? kWidest->range : nullptr};
std::atomic<Attend> g_attend{kWidest ? kWidest->attend : nullptr};
std::atomic<Softmax> g_softmax{kWidest ? kWidest->softmax : nullptr};
std::atomic<QuantRange> g_quant{kWidest ? kWidest->quant : nullptr};
std::atomic<const Kernel*> g_gather{kWidest};  // the gathered LoRA's kernels

// A spin-wait's hint to the core that this thread only waits.
inline void spin_pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  __asm__ __volatile__("yield");
#endif
}

// Threads for one call at a time. A call's work is cut into chunks that every thread, the
// caller's included, claims until none is left: a thread the OS has set aside for another
// process holds up only a chunk it has claimed, never the whole call. Between calls (a decode
// step makes hundreds, microseconds apart) the workers spin a little, yielding, then sleep.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; i++) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      state_.store(next_generation() << 32);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // task(c) for every c < chunks (at most 65535), on whichever threads claim them; returns when
  // all are done.
  void run(int chunks, const std::function<void(int)>& task) {
    if (workers_.empty() || chunks == 1) {
      for (int c = 0; c < chunks; c++) task(c);
      return;
    }
    task_ = &task;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = next_generation();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state_.store(generation << 32 | static_cast<uint64_t>(chunks) << 16,
                   std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    const int mine = work(generation);
    for (int spins = 1; done_.load(std::memory_order_acquire) + mine < chunks; spins++) {
      spin_pause();
      if (spins % 64 == 0) std::this_thread::yield();
    }
  }

 private:
  // state_: generation (32 bits) | chunks (16) | chunks claimed so far (16).
  uint64_t next_generation() const {
    return ((state_.load(std::memory_order_relaxed) >> 32) + 1) & 0xffffffffu;
  }

  // Claims and runs chunks of `generation` while any is left; returns how many it ran. A chunk
  // claimed is one the caller waits for, so task_ stays this generation's until it is done.
  int work(uint64_t generation) {
    int ran = 0;
    uint64_t s = state_.load(std::memory_order_acquire);
    while (s >> 32 == generation && (s & 0xffff) < (s >> 16 & 0xffff)) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
        (*task_)(static_cast<int>(s & 0xffff));
        ran++;
        s = state_.load(std::memory_order_acquire);
      }
    }
    return ran;
  }

  void loop() {
    uint64_t seen = 0;  // the generation a new pool starts at, even if this thread starts late
    const auto changed = [&] { return state_.load(std::memory_order_acquire) >> 32 != seen; };
    while (true) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; !changed(); spins++) {
        spin_pause();
        if (spins % 256 != 0) continue;
        if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(300)) {
          std::this_thread::yield();
          continue;
        }
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, changed);
        sleeping_.fetch_sub(1);
      }
      seen = state_.load(std::memory_order_acquire) >> 32;
      if (stop_.load()) return;
      if (const int ran = work(seen)) done_.fetch_add(ran, std::memory_order_release);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* task_ = nullptr;
};

// The threads of every product; set_threads replaces them between products.
std::mutex g_pool_mutex;
std::unique_ptr<Pool> g_pool;

// body(n0, n1) over [0, n) in chunks of at least `least` rows (bounds on multiples of `align`:
// 4, the matmul kernel's blocks, unless told), a few per thread of the pool so that the threads
// even out.
void parallel_rows(int n, int least, const std::function<void(int, int)>& body, int align = 4) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_unique<Pool>(1);
  const int threads = g_pool->size();
  const int chunks = std::clamp(n / least, 1, threads == 1 ? 1 : 4 * threads);
  const auto bound = [&](int c) {
    if (c == chunks) return n;
    const auto at = static_cast<int>(static_cast<int64_t>(n) * c / chunks);
    return at - at % align;
  };
  g_pool->run(chunks, [&](int c) { body(bound(c), bound(c + 1)); });
}

int set_threads(int threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  threads = std::clamp(threads, 1, 256);  // a call's chunks (4 per thread) fit in 16 bits
  if (!g_pool || g_pool->size() != threads) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(threads);
  }
  return g_pool->size();
}

// An input's elements in row-major order, read where the kernel runs: the input's own buffer
// when it is row-contiguous (the usual case, no copy), else a packed copy of its strided view.
// The layout is known when the primitive is evaluated; the data only once the inputs' own work,
// queued before it on the stream, has run.
class RowMajor {
 public:
  explicit RowMajor(const mx::array& a)
      : data_(a.data<float>()), shape_(a.shape()), strides_(a.strides()),
        contiguous_(a.flags().row_contiguous) {}

  const float* get() {
    if (contiguous_) return data_;
    if (packed_.empty()) {
      size_t size = 1;
      for (int n : shape_) size *= n;
      packed_.reserve(size);
      pack(0, data_);
    }
    return packed_.data();
  }

 private:
  void pack(size_t axis, const float* from) {
    for (int i = 0; i < shape_[axis]; i++, from += strides_[axis]) {
      if (axis + 1 == shape_.size())
        packed_.push_back(*from);
      else
        pack(axis + 1, from);
    }
  }

  const float* data_;
  mx::Shape shape_;
  mx::Strides strides_;
  bool contiguous_;
  std::vector<float> packed_;
};

// Shared by the primitives of this file: the output's allocation, and body(operands, out) queued on
// the stream with the first `floats` inputs as RowMajor operands.
template <typename Body>
void dispatch_rows(const mx::Stream& stream, const std::vector<mx::array>& inputs, size_t floats,
                   mx::array& out, Body body) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& input : inputs) encoder.set_input_array(input);
  encoder.set_output_array(out);
  std::vector<RowMajor> operands(inputs.begin(), inputs.begin() + floats);
  encoder.dispatch([operands = std::move(operands), op = out.data<float>(), body]() mutable {
    body(operands, op);
  });
}

// The primitives of this file run on the CPU only.
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }
};

class RowsMatmul : public CpuPrimitive {
 public:
  explicit RowsMatmul(mx::Stream stream) : CpuPrimitive(stream) {}

  // inputs: x [..., K], w; with LoRA also a_t [R, K], b_t [N, R], mask [..., R].
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), N = inputs[1].shape(0);
    const int R = inputs.size() == 5 ? inputs[2].shape(0) : 0;
    dispatch_rows(stream(), inputs, inputs.size(), outputs[0],
                  [M, N, K, R, kernel = g_kernel.load()](auto& operands, float* op) {
      const float* xp = operands[0].get();
      const float* wp = operands[1].get();
      std::vector<float> h;  // [M, R]: each row's low-rank activations, times its scales
      Seg extra;
      if (R > 0) {
        const float* ap = operands[2].get();
        const float* bp = operands[3].get();
        const float* maskp = operands[4].get();
        h.resize(static_cast<size_t>(M) * R);
        parallel_rows(R, 8, [&](int r0, int r1) {
          kernel(Seg{xp, ap, K}, Seg{}, h.data(), M, R, r0, r1);
          for (int m = 0; m < M; m++)
            for (int r = r0; r < r1; r++) h[m * R + r] *= maskp[m * R + r];
        });
        extra = Seg{h.data(), bp, R};
      }
      parallel_rows(N, 64, [&](int n0, int n1) {
        kernel(Seg{xp, wp, K}, extra, op, M, N, n0, n1);
      });
    });
  }
  const char* name() const override { return "RowsMatmul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

void check_float32(const std::vector<mx::array>& arrays) {
  for (const auto& a : arrays)
    if (a.ndim() < 2 || a.dtype() != mx::float32 || a.shape(-1) == 0)
      throw std::invalid_argument(
          "rows_matmul: float32 arrays of two or more dimensions, rows not empty, only");
  if (g_kernel.load() == nullptr)
    throw std::invalid_argument("rows_matmul: the CPU lacks AVX2 and FMA");
}

// x [..., K] against w [N, K]: out [..., N].
mx::array rows_primitive(std::vector<mx::array> inputs) {
  const auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return mx::array(shape, mx::float32, std::make_shared<RowsMatmul>(s), std::move(inputs));
}

mx::array rows_matmul(const mx::array& x, const mx::array& w) {
  check_float32({x, w});
  if (w.ndim() != 2 || x.shape(-1) != w.shape(1))
    throw std::invalid_argument("rows_matmul: expected x [..., K] and w [N, K]");
  return rows_primitive({x, w});
}

mx::array rows_matmul_lora(
    const mx::array& x, const mx::array& w, const mx::array& a_t, const mx::array& b_t,
    const mx::array& mask) {
  check_float32({x, w, a_t, b_t, mask});
  const auto K = x.shape(-1), N = w.shape(0), R = a_t.shape(0);
  const auto M = x.size() / K;
  if (w.ndim() != 2 || a_t.ndim() != 2 || b_t.ndim() != 2 || w.shape(1) != K ||
      a_t.shape(1) != K || b_t.shape(0) != N || b_t.shape(1) != R || mask.shape(-1) != R ||
      mask.size() != M * R)
    throw std::invalid_argument(
        "rows_matmul_lora: expected x [..., K] (M rows), w [N, K], a_t [R, K], b_t [N, R], "
        "mask [..., R] (M rows)");
  return rows_primitive({x, w, a_t, b_t, mask});
}

// A packed weight's operands as the kernel reads them (w [N, K * bits / 32] uint32, scales and
// biases [N, K / group]), each row-contiguous, else refused in `name`'s words.
Quantized packed_weight(const mx::array& w, const mx::array& scales, const mx::array& biases,
                        int K, int bits, int group, const char* name) {
  for (const auto* a : {&w, &scales, &biases})
    if (!a->flags().row_contiguous)
      throw std::invalid_argument(std::string(name) + ": the weights must be row-contiguous");
  const int dtype = scales.dtype() == mx::float32 ? 0 : scales.dtype() == mx::float16 ? 1 : 2;
  return Quantized{w.data<uint32_t>(), scales.data<void>(), biases.data<void>(), K, bits, group,
                   dtype};
}

// A tile in L1 for the few rows of a decode step; larger ones (L2) for a prompt's many.
int tile_floats(int M) { return M <= 16 ? 8192 : 32768; }

// out [M, N] = x [M, K] @ dequantize(q).T, the columns split over the pool's threads.
void quant_rows(QuantRange quant, const Quantized& q, const float* x, float* out, int M, int N) {
  const int floats = tile_floats(M);
  parallel_rows(N, 64, [&](int n0, int n1) {
    thread_local std::vector<float> tile;
    tile.resize(std::max<size_t>(floats, 4 * static_cast<size_t>(q.K)));
    quant(q, x, out, M, N, n0, n1, tile.data(), floats);
  });
}

// `x @ dequantize(w, scales, biases).T` for MLX's affine-quantized weights, any number of rows:
// a request alone, a batched decode step, a prefill chunk. The weights stay packed in memory;
// each thread dequantizes a tile of weight rows at a time into a buffer that stays in cache and
// multiplies every row of x by it. Each output is one fixed-order sum over K, so a row's result
// does not depend on the other rows, however many: a batch or a prompt's chunking changes no
// bit. With LoRA, QuantMatmulGather adds each row's own residuals after the same products.
class QuantMatmul : public CpuPrimitive {
 public:
  QuantMatmul(mx::Stream stream, int bits, int group)
      : CpuPrimitive(stream), bits_(bits), group_(group) {}

  // inputs: x [..., K], w [N, K * bits / 32] uint32, scales and biases [N, K / group].
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), N = inputs[1].shape(0);
    const Quantized q =
        packed_weight(inputs[1], inputs[2], inputs[3], K, bits_, group_, "quant_matmul");
    dispatch_rows(stream(), inputs, 1, outputs[0],
                  [=, quant = g_quant.load()](auto& operands, float* op) {
      quant_rows(quant, q, operands[0].get(), op, M, N);
    });
  }
  const char* name() const override { return "QuantMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmul&>(other);
    return bits_ == o.bits_ && group_ == o.group_;
  }

 private:
  int bits_;
  int group_;
};

void check_quantized(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group, int bits) {
  if (g_quant.load() == nullptr)
    throw std::invalid_argument("quant_matmul: the CPU lacks AVX2 and FMA");
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) == 0)
    throw std::invalid_argument("quant_matmul: x must be float32 [..., K]");
  if (bits != 4 && bits != 8)
    throw std::invalid_argument("quant_matmul: 4 or 8 bits only");
  if (group != 32 && group != 64 && group != 128)
    throw std::invalid_argument("quant_matmul: groups of 32, 64 or 128 only");
  const auto dtype = scales.dtype();
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16)
    throw std::invalid_argument("quant_matmul: float32, float16 or bfloat16 scales only");
  const int K = x.shape(-1);
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || K % group != 0 ||
      static_cast<int64_t>(w.shape(1)) * 32 / bits != K || biases.dtype() != dtype ||
      scales.shape() != mx::Shape{w.shape(0), K / group} || biases.shape() != scales.shape())
    throw std::invalid_argument(
        "quant_matmul: expected x [..., K], w [N, K * bits / 32] uint32, and scales and "
        "biases [N, K / group] of one dtype");
}

mx::array quant_primitive(std::vector<mx::array> inputs, int N, int group, int bits) {
  const auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = inputs[0].shape();
  shape.back() = N;
  return mx::array(shape, mx::float32, std::make_shared<QuantMatmul>(s, bits, group),
                   std::move(inputs));
}

mx::array quant_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                       const mx::array& biases, int group_size, int bits) {
  check_quantized(x, w, scales, biases, group_size, bits);
  return quant_primitive({x, w, scales, biases}, w.shape(0), group_size, bits);
}

// One adapter's pairs as mounted, at each LoRA slot of the model that it has weights at: a [K, r]
// and b [r, N], row-major, float32 (`--adapter-dtype float32`) or float16 (the default). The
// arrays are held here, so a primitive that holds this reads them wherever Python's references
// have gone; they are not the primitive's inputs (evaluated once, at the mount), so a step's
// graph carries no array of any adapter. Made and shared from C++ alone (enable_shared_from_this: nanobind hands
// C++ the object's own shared_ptr, not one whose deleter takes the GIL), so the last reference,
// dropped where a step ran, frees it there without waiting for Python.
struct AdapterPairs : std::enable_shared_from_this<AdapterPairs> {
  struct Pair {
    const void* a;
    const void* b;
    int K, r, N;
    bool half;
  };
  std::vector<mx::array> arrays;
  std::vector<std::optional<Pair>> slots;  // by slot number

  const Pair* at(int slot) const {
    return slot >= 0 && static_cast<size_t>(slot) < slots.size() && slots[slot]
               ? &*slots[slot]
               : nullptr;
  }
};

// The adapters of one batch's rows and each row's entries, the same at every slot: its S + 1
// offsets into the E entries (row s's are [offsets[s], offsets[s + 1])), each entry's adapter
// (an index into `adapters`) and scale, in its set's order. At a slot an entry whose adapter has
// no weights there adds nothing. Shared from C++ alone, as AdapterPairs.
struct RowPlan : std::enable_shared_from_this<RowPlan> {
  RowPlan(std::vector<std::shared_ptr<AdapterPairs>> adapters, std::vector<int32_t> offsets,
          std::vector<int32_t> entries, std::vector<float> scales)
      : adapters(std::move(adapters)), offsets(std::move(offsets)), entries(std::move(entries)),
        scales(std::move(scales)) {}

  std::vector<std::shared_ptr<AdapterPairs>> adapters;
  std::vector<int32_t> offsets;
  std::vector<int32_t> entries;
  std::vector<float> scales;

  int rows() const { return static_cast<int>(offsets.size()) - 1; }
};

// The gathered form of QuantMatmul's LoRA (Punica's BGMV): each adapter's pair is read where it
// is mounted, and the plan says which adapters each row applies, in its set's order, at which
// scale. A row computes only its own adapters' activations (low_rank_row), then, after its base
// product, adds (h * scale) @ b for each of them in order, column by column (add_residuals): the
// operations on a row's outputs are fixed by its own set alone, so its bits are the same alone
// and beside any other rows and adapters, and no pair is copied. RowResiduals does this for one
// product (QuantMatmulGather) or for several products of the same rows (QuantMatmulHeads' q, k
// and v, or gate and up), one pass of the pool's threads for all of their activations and one
// for all of their residuals.
class RowResiduals {
 public:
  // x [M, K] row-major, the rows of every product added.
  RowResiduals(const Kernel* kernel, const float* x, int M, int K)
      : kernel_(kernel), x_(x), M_(M), K_(K) {}

  // One product's residuals at `slot`, added to `out` [M, N] row-major (its base product): one
  // unit per row and entry of its set whose adapter has weights at the slot (row m is the plan's
  // row m / (M / S)).
  void add(const RowPlan& plan, int slot, int N, float* out) {
    const int j = static_cast<int>(products_.size());
    const int per_row = M_ / plan.rows();
    for (int m = 0; m < M_; m++) {
      first_.push_back(static_cast<int>(units_.size()));
      const int s = m / per_row;
      for (int e = plan.offsets[s]; e < plan.offsets[s + 1]; e++) {
        const AdapterPairs::Pair* pair = plan.adapters[plan.entries[e]]->at(slot);
        if (pair == nullptr) continue;  // no weights here: adds nothing
        units_.push_back({j, m, pair, plan.scales[e], floats_});
        floats_ += pair->r;
        widest_ = std::max(widest_, pair->r);
      }
    }
    spans_.push_back(std::max(1, N / 512));
    items_.push_back(items_.back() + M_ * spans_.back());
    products_.push_back({N, out});
  }

  bool empty() const { return units_.empty(); }

  // Every unit's activations, h = scale * (x[m] @ a), one pass.
  void activations() {
    h_.resize(floats_);
    parallel_rows(static_cast<int>(units_.size()), 4, [&](int u0, int u1) {
      for (int u = u0; u < u1; u++) {
        const Unit& unit = units_[u];
        const float* x = x_ + static_cast<size_t>(unit.m) * K_;
        const AdapterPairs::Pair& p = *unit.pair;
        if (p.half)
          kernel_->low_rank_half(x, static_cast<const uint16_t*>(p.a), K_, p.r, unit.scale,
                                 h_.data() + unit.h);
        else
          kernel_->low_rank(x, static_cast<const float*>(p.a), K_, p.r, unit.scale,
                            h_.data() + unit.h);
      }
    }, /*align=*/1);
  }

  // Then each row's residuals on each product's base output, one pass, a row at a time in spans
  // of at least 512 columns: b's rows are read in runs of 2 KiB or more, which the memory
  // streams, not in a tile's few cache lines each.
  void residuals() {
    std::vector<int> columns(widest_);  // every column of an adapter, in order
    for (int r = 0; r < widest_; r++) columns[r] = r;
    parallel_rows(items_.back(), 1, [&](int c0, int c1) {
      int j = 0;
      for (int c = c0; c < c1; c++) {
        while (c >= items_[j + 1]) j++;
        const Product& p = products_[j];
        const int spans = spans_[j], m = (c - items_[j]) / spans, part = (c - items_[j]) % spans;
        const int n0 = bound(p.N, spans, part), n1 = bound(p.N, spans, part + 1);
        float* out = p.out + static_cast<size_t>(m) * p.N;
        const size_t row = static_cast<size_t>(j) * M_ + m;
        const int end = row + 1 < first_.size() ? first_[row + 1] : static_cast<int>(units_.size());
        for (int u = first_[row]; u < end; u++) {
          const Unit& unit = units_[u];
          const AdapterPairs::Pair& pair = *unit.pair;
          if (pair.half)
            kernel_->residuals_half(h_.data() + unit.h, static_cast<const uint16_t*>(pair.b), p.N,
                                    columns.data(), pair.r, out, n0, n1);
          else
            kernel_->residuals(h_.data() + unit.h, static_cast<const float*>(pair.b), p.N,
                               columns.data(), pair.r, out, n0, n1);
        }
      }
    }, /*align=*/1);
  }

 private:
  struct Product {
    int N;
    float* out;
  };
  struct Unit {
    int j, m;  // product, row
    const AdapterPairs::Pair* pair;
    float scale;
    size_t h;  // its activations' offset
  };

  // A span's bounds: multiples of 16 (whole vectors), but the last.
  static int bound(int N, int spans, int part) {
    const int at = static_cast<int>(static_cast<int64_t>(N) * part / spans);
    return part == spans ? N : at - at % 16;
  }

  const Kernel* kernel_;
  const float* x_;
  int M_, K_;
  std::vector<Product> products_;
  std::vector<Unit> units_;
  std::vector<int> first_;  // product j's row m's units start at first_[j * M + m]
  std::vector<int> spans_;  // each product's spans a row
  std::vector<int> items_{0};  // product j's (row, span) items are [items_[j], items_[j + 1])
  size_t floats_ = 0;
  int widest_ = 0;
  std::vector<float> h_;
};

// Checks that a plan serves x's M rows (its rows divide them evenly) and that each of its
// adapters' pairs at `slot` takes x's K inputs to N outputs.
void check_plan(const char* name, const mx::array& x, int N, const RowPlan& plan, int slot) {
  if (g_gather.load() == nullptr)
    throw std::invalid_argument(std::string(name) + ": no vector kernel for this CPU");
  const int K = x.shape(-1);
  const int64_t M = x.size() / K;
  if (M % plan.rows() != 0)
    throw std::invalid_argument(std::string(name) +
                                ": the plan's rows must divide x's rows evenly");
  for (const auto& adapter : plan.adapters) {
    const AdapterPairs::Pair* pair = adapter->at(slot);
    if (pair != nullptr && (pair->K != K || pair->N != N))
      throw std::invalid_argument(std::string(name) + ": an adapter's pair at slot " +
                                  std::to_string(slot) + " is [" + std::to_string(pair->K) +
                                  ", r], [r, " + std::to_string(pair->N) + "], not [" +
                                  std::to_string(K) + ", r], [r, " + std::to_string(N) + "]");
  }
}

class QuantMatmulGather : public CpuPrimitive {
 public:
  QuantMatmulGather(mx::Stream stream, int bits, int group, std::shared_ptr<const RowPlan> plan,
                    int slot)
      : CpuPrimitive(stream), bits_(bits), group_(group), plan_(std::move(plan)), slot_(slot) {}

  // inputs: x [..., K] (M rows, M / S a row of the plan), then w, scales, biases as
  // QuantMatmul's; the plan's adapters' pairs at the slot are added.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), N = inputs[1].shape(0);
    const Quantized q = packed_weight(inputs[1], inputs[2], inputs[3], K, bits_, group_,
                                      "quant_matmul_gather");
    dispatch_rows(stream(), inputs, 1, outputs[0],
                  [=, plan = plan_, slot = slot_, quant = g_quant.load(),
                   gather = g_gather.load()](auto& operands, float* op) {
      const float* xp = operands[0].get();
      RowResiduals residuals(gather, xp, M, K);
      residuals.add(*plan, slot, N, op);
      if (!residuals.empty()) residuals.activations();
      quant_rows(quant, q, xp, op, M, N);
      if (!residuals.empty()) residuals.residuals();
    });
  }
  const char* name() const override { return "QuantMatmulGather"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmulGather&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && plan_ == o.plan_ && slot_ == o.slot_;
  }

 private:
  int bits_;
  int group_;
  std::shared_ptr<const RowPlan> plan_;
  int slot_;
};

// `quant_matmul(x, w, ...)` plus each row's own adapters' residuals at `slot` (`plan`'s).
mx::array quant_matmul_gather(const mx::array& x, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits,
                              std::shared_ptr<RowPlan> plan, int slot) {
  check_quantized(x, w, scales, biases, group_size, bits);
  const int N = w.shape(0);
  if (!plan) throw std::invalid_argument("quant_matmul_gather: expected a plan");
  check_plan("quant_matmul_gather", x, N, *plan, slot);
  mx::Shape shape = x.shape();
  shape.back() = N;
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32,
                   std::make_shared<QuantMatmulGather>(s, bits, group_size, std::move(plan), slot),
                   {x, w, scales, biases});
}

// An adapter's pairs for the gathered kernels: pairs[slot] is (a [K, r], b [r, N]), both float32
// or both float16, row-major, or None where it has no weights. Each is evaluated here.
std::shared_ptr<AdapterPairs> adapter_pairs(
    const std::vector<std::optional<std::pair<mx::array, mx::array>>>& pairs) {
  auto out = std::make_shared<AdapterPairs>();
  for (const auto& found : pairs) {
    if (!found) {
      out->slots.emplace_back();
      continue;
    }
    auto [a, b] = *found;
    a.eval(), b.eval();
    const auto dtype = a.dtype();
    if ((dtype != mx::float32 && dtype != mx::float16) || b.dtype() != dtype || a.ndim() != 2 ||
        b.ndim() != 2 || a.shape(1) == 0 || b.shape(0) != a.shape(1) ||
        !a.flags().row_contiguous || !b.flags().row_contiguous)
      throw std::invalid_argument(
          "adapter_pairs: expected pairs a [K, r], b [r, N], both float32 or both float16, "
          "row-major");
    out->slots.push_back(AdapterPairs::Pair{a.data<void>(), b.data<void>(), a.shape(0),
                                            a.shape(1), b.shape(1), dtype == mx::float16});
    out->arrays.push_back(std::move(a));
    out->arrays.push_back(std::move(b));
  }
  return out;
}

// A batch's plan: its adapters (each's pairs, once), then the S + 1 offsets into the entries,
// each entry's adapter (an index into `adapters`) and its scale.
std::shared_ptr<RowPlan> row_plan(std::vector<std::shared_ptr<AdapterPairs>> adapters,
                                  std::vector<int32_t> offsets, std::vector<int32_t> entries,
                                  std::vector<float> scales) {
  const int count = static_cast<int>(adapters.size());
  const int E = static_cast<int>(entries.size());
  bool ok = offsets.size() >= 2 && offsets.front() == 0 && offsets.back() == E &&
            scales.size() == entries.size();
  for (size_t s = 0; ok && s + 1 < offsets.size(); s++) ok = offsets[s] <= offsets[s + 1];
  for (int e = 0; ok && e < E; e++) ok = entries[e] >= 0 && entries[e] < count;
  for (const auto& adapter : adapters) ok = ok && adapter != nullptr;
  if (!ok)
    throw std::invalid_argument(
        "row_plan: the offsets must rise from 0 to the entries' count, one row at least, each "
        "entry name one of the adapters, with one scale each");
  return std::make_shared<RowPlan>(std::move(adapters), std::move(offsets), std::move(entries),
                                   std::move(scales));
}

// x @ dequantize(w_j).T for several weights of one input at once (a layer's q, k and v, or its
// gate and up): one primitive and one pass of the pool's threads where separate products take
// one each. Each output is computed by quant_matmul's kernel on the same rows, so its bits are
// quant_matmul's; an output with a slot adds each row's own adapters' residuals there as
// quant_matmul_gather does (RowResiduals, all the outputs' in one pass), to its bits. x [B, L, K];
// output j is [B, heads_j, L, N_j / heads_j] (the attention's layout, with the reshape and
// transpose that would make it done here), or [B, L, N_j] where heads_j is 0. At L = 1 the two
// layouts are the same bytes; otherwise the products (and residuals) go to a scratch buffer in
// rows' order first.
class QuantMatmulHeads : public CpuPrimitive {
 public:
  // slots[j]: output j's LoRA slot, whose residuals `plan` adds (-1: none; slots is empty when
  // no output has one).
  QuantMatmulHeads(mx::Stream stream, int bits, int group, std::vector<int> heads,
                   std::shared_ptr<const RowPlan> plan, std::vector<int> slots)
      : CpuPrimitive(stream), bits_(bits), group_(group), heads_(std::move(heads)),
        plan_(std::move(plan)), slots_(std::move(slots)) {}

  // inputs: x, then w, scales and biases of each output.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), L = x.shape(1);
    const int count = static_cast<int>(outputs.size());
    std::vector<Quantized> weights;
    std::vector<int> widths, offsets{0};
    for (int j = 0; j < count; j++) {
      const int at = 1 + 3 * j;
      const int N = inputs[at].shape(0);
      weights.push_back(packed_weight(inputs[at], inputs[at + 1], inputs[at + 2], K, bits_, group_,
                                      "quant_matmul_heads"));
      widths.push_back(N);
      offsets.push_back(offsets.back() + N);
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& input : inputs) encoder.set_input_array(input);
    std::vector<float*> outs;
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
      outs.push_back(out.data<float>());
    }
    encoder.dispatch([source = RowMajor(x), weights, widths, offsets, outs, plan = plan_,
                      slots = slots_, heads = heads_, M, L, K, quant = g_quant.load(),
                      gather = g_gather.load()]() mutable {
      const float* xp = source.get();
      const int count = static_cast<int>(weights.size());
      // Where each product is written: its output, or a scratch [M, N_j] to lay out after.
      std::vector<std::vector<float>> scratch(count);
      std::vector<float*> products(outs);
      for (int j = 0; j < count; j++)
        if (heads[j] > 0 && L > 1) {
          scratch[j].resize(static_cast<size_t>(M) * widths[j]);
          products[j] = scratch[j].data();
        }
      RowResiduals residuals(gather, xp, M, K);
      for (size_t j = 0; j < slots.size(); j++)
        if (slots[j] >= 0) residuals.add(*plan, slots[j], widths[j], products[j]);
      if (!residuals.empty()) residuals.activations();
      const int floats = tile_floats(M);
      parallel_rows(offsets.back(), 64, [&](int n0, int n1) {
        thread_local std::vector<float> tile;
        for (int j = 0; j < count; j++) {
          const int a = std::max(n0, offsets[j]) - offsets[j];
          const int b = std::min(n1, offsets[j + 1]) - offsets[j];
          if (a >= b) continue;
          tile.resize(std::max<size_t>(floats, 4 * static_cast<size_t>(weights[j].K)));
          quant(weights[j], xp, products[j], M, widths[j], a, b, tile.data(), floats);
        }
      });
      if (!residuals.empty()) residuals.residuals();
      for (int j = 0; j < count; j++) {
        if (scratch[j].empty()) continue;
        const int H = heads[j], N = widths[j], D = N / H, B = M / L;
        for (int b = 0; b < B; b++)  // [B, L, H, D] to [B, H, L, D]
          for (int l = 0; l < L; l++)
            for (int h = 0; h < H; h++)
              std::copy_n(scratch[j].data() + (static_cast<size_t>(b) * L + l) * N + h * D, D,
                          outs[j] + ((static_cast<size_t>(b) * H + h) * L + l) * D);
      }
    });
  }
  const char* name() const override { return "QuantMatmulHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmulHeads&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && heads_ == o.heads_ && plan_ == o.plan_ &&
           slots_ == o.slots_;
  }

 private:
  int bits_;
  int group_;
  std::vector<int> heads_;
  std::shared_ptr<const RowPlan> plan_;
  std::vector<int> slots_;
};

// `quant_matmul` of x [B, L, K] by each of `ws` (w, scales, biases triplets, one quantization)
// as one primitive; output j is [B, heads[j], L, N_j / heads[j]], or [B, L, N_j] for heads 0,
// plus each row's own adapters' residuals at slots[j] where `plan` is given and slots[j] >= 0
// (slots: one for each output, or empty).
std::vector<mx::array> quant_matmul_heads(const mx::array& x, const std::vector<mx::array>& ws,
                                          const std::vector<mx::array>& scales,
                                          const std::vector<mx::array>& biases,
                                          const std::vector<int>& heads, int group_size,
                                          int bits, std::shared_ptr<RowPlan> plan,
                                          std::vector<int> slots) {
  if (ws.empty() || scales.size() != ws.size() || biases.size() != ws.size() ||
      heads.size() != ws.size() || (!slots.empty() && slots.size() != ws.size()))
    throw std::invalid_argument(
        "quant_matmul_heads: expected as many weights, scales, biases, heads and slots (or "
        "none), at least one");
  if (x.ndim() != 3)
    throw std::invalid_argument("quant_matmul_heads: expected x [B, L, K]");
  if (!plan) slots.clear();
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes;
  const int B = x.shape(0), L = x.shape(1);
  for (size_t j = 0; j < ws.size(); j++) {
    check_quantized(x, ws[j], scales[j], biases[j], group_size, bits);
    const int N = ws[j].shape(0), H = heads[j];
    if (H < 0 || (H > 0 && N % H != 0))
      throw std::invalid_argument("quant_matmul_heads: heads must divide the weight's rows");
    shapes.push_back(H > 0 ? mx::Shape{B, H, L, N / H} : mx::Shape{B, L, N});
    inputs.insert(inputs.end(), {ws[j], scales[j], biases[j]});
    if (!slots.empty() && slots[j] >= 0) check_plan("quant_matmul_heads", x, N, *plan, slots[j]);
  }
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(
      std::move(shapes), std::vector<mx::Dtype>(ws.size(), mx::float32),
      std::make_shared<QuantMatmulHeads>(s, bits, group_size, heads, std::move(plan),
                                         std::move(slots)),
      std::move(inputs));
}

// RMSNorm and RoPE, each one primitive: MLX's CPU backend composes them from ten to thirty small
// operations, and at a few rows each costs more to schedule than to compute. Each is MLX's
// composition step for step, in float32 (one rounding an operation, MLX's own exp, sin and
// cos), so its results are MLX's to the bit; this code is built without FMA, as MLX is, so that
// no product and sum are fused into one rounding.

// x * rsqrt(mean(x^2) + eps) * weight over the last axis of x [..., D]; weight [D]. The squares
// are summed in order, as MLX's CPU reduction sums them.
class RowsRMSNorm : public CpuPrimitive {
 public:
  RowsRMSNorm(mx::Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int D = inputs[0].shape(-1), M = static_cast<int>(inputs[0].size() / D);
    dispatch_rows(stream(), inputs, 2, outputs[0], [M, D, eps = eps_](auto& operands, float* op) {
      const float* xp = operands[0].get();
      const float* wp = operands[1].get();
      const float inverse_d = static_cast<float>(1.0 / D);  // MLX's mean: the sum times 1 / D
      for (int m = 0; m < M; m++) {
        const float* x = xp + static_cast<size_t>(m) * D;
        float sum = 0.0f;
        for (int d = 0; d < D; d++) {
          const float square = x[d] * x[d];
          sum += square;
        }
        const float scale = 1.0f / std::sqrt(sum * inverse_d + eps);
        float* o = op + static_cast<size_t>(m) * D;
        for (int d = 0; d < D; d++) {
          const float normed = x[d] * scale;
          o[d] = normed * wp[d];
        }
      }
    });
  }
  const char* name() const override { return "RowsRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RowsRMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

float simd_exp(float x) { return mx::simd::exp(mx::simd::Simd<float, 1>(x)).value; }

// Rotary position embedding of x [B, N, T, D] at positions (offset[b] + t) * scale, as
// mx.fast.rope: the first `dims` features rotated in pairs (i, i + dims / 2), or (2i, 2i + 1)
// when traditional, by angle position * base^(-i / (dims / 2)); the rest copied.
class RowsRoPE : public CpuPrimitive {
 public:
  RowsRoPE(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : CpuPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int B = x.shape(0), N = x.shape(1), T = x.shape(2), D = x.shape(3);
    const int32_t* offset = inputs[1].data<int32_t>();  // one per row, or one for all
    const int64_t offset_stride = inputs[1].size() == 1 ? 0 : inputs[1].strides()[0];
    const int half = dims_ / 2;
    const bool traditional = traditional_;
    const float scale = scale_;
    std::vector<float> inv_freqs(half);
    const float step = std::log(base_) / half;
    for (int i = 0; i < half; i++) inv_freqs[i] = simd_exp(static_cast<float>(-i) * step);
    dispatch_rows(stream(), inputs, 1, outputs[0], [=](auto& operands, float* op) {
      const float* xp = operands[0].get();
      std::vector<float> cos_t(half), sin_t(half);
      for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
          const int32_t start = offset[b * offset_stride];
          const float position = (static_cast<float>(t) + static_cast<float>(start)) * scale;
          for (int i = 0; i < half; i++) {
            const float theta = position * inv_freqs[i];
            cos_t[i] = mx::simd::cos(mx::simd::Simd<float, 1>(theta)).value;
            sin_t[i] = mx::simd::sin(mx::simd::Simd<float, 1>(theta)).value;
          }
          for (int n = 0; n < N; n++) {
            const size_t row = ((static_cast<size_t>(b) * N + n) * T + t) * D;
            const float* in = xp + row;
            float* o = op + row;
            for (int i = 0; i < half; i++) {
              const int i1 = traditional ? 2 * i : i, i2 = traditional ? 2 * i + 1 : i + half;
              const float x1 = in[i1], x2 = in[i2];
              const float x1c = x1 * cos_t[i], x2s = x2 * sin_t[i];
              const float x1s = x1 * sin_t[i], x2c = x2 * cos_t[i];
              o[i1] = x1c - x2s;
              o[i2] = x1s + x2c;
            }
            for (int d = 2 * half; d < D; d++) o[d] = in[d];
          }
        }
      }
    });
  }
  const char* name() const override { return "RowsRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RowsRoPE&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
           scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

// A KV cache's keys or values [B, heads, S, D] for `attention_rows`: read in place when each
// position's D floats are contiguous (a slice of the cache), else from a packed copy.
class CacheView {
 public:
  explicit CacheView(const mx::array& a)
      : source_(a), data_(a.data<float>()), strides_(a.strides()), in_place_(a.strides(3) == 1) {
    if (!in_place_) {
      strides_[3] = 1, strides_[2] = a.shape(3);
      strides_[1] = strides_[2] * a.shape(2), strides_[0] = strides_[1] * a.shape(1);
    }
  }
  // In the task, once the data is there.
  void prepare() {
    if (!in_place_) data_ = source_.get();
  }
  const float* at(int b, int h) const { return data_ + b * strides_[0] + h * strides_[1]; }
  int64_t step() const { return strides_[2]; }

 private:
  RowMajor source_;
  const float* data_;
  mx::Strides strides_;
  bool in_place_;
};

// softmax(q * scale . k^T over the keys the mask shows) . v, each query token on its own: a
// batched decode step's attention, each row on its own keys, in one primitive where MLX's CPU
// backend takes about twenty; with the quantized weights' kernels, every step's (a request
// alone, a prompt's chunks), so that a token's result does not depend on the other rows of the
// batch or on how its prompt was cut into chunks. q [B, H, L, D]; k [B, Hkv, S, D] and
// v [B, Hkv, S, Dv], views of a KV cache; mask [B, 1, L, S] bool (a broadcast view reads in
// place). Query head h reads KV head h / (H / Hkv), as MLX groups them.
class RowsAttention : public CpuPrimitive {
 public:
  // merged: the output as [B, L, H * Dv], the heads side by side (`attention_rows_merged`).
  RowsAttention(mx::Stream stream, float scale, bool merged = false)
      : CpuPrimitive(stream), scale_(scale), merged_(merged) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    const auto& mask = inputs[3];
    const int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
    const int Hkv = inputs[1].shape(1), S = inputs[1].shape(2), Dv = inputs[2].shape(3);
    const int G = H / Hkv;
    const bool* visible = mask.data<bool>();
    const int64_t mask_row = mask.strides(0), mask_token = mask.strides(2);
    const int64_t mask_step = mask.strides(3);
    dispatch_rows(stream(), inputs, 1, outputs[0],
                  [=, scale = scale_, merged = merged_, keys = CacheView(inputs[1]),
                   values = CacheView(inputs[2]),
                   attend = g_attend.load()](auto& operands, float* op) mutable {
      const float* qp = operands[0].get();
      keys.prepare(), values.prepare();
      parallel_rows(B * Hkv * L, 1, [&](int u0, int u1) {
        std::vector<float> scaled(static_cast<size_t>(G) * D), scores(static_cast<size_t>(G) * S);
        std::vector<float> out(static_cast<size_t>(G) * Dv);
        for (int u = u0; u < u1; u++) {
          const int b = u / (Hkv * L), h = u / L % Hkv, l = u % L;
          const size_t first = static_cast<size_t>(b) * H + static_cast<size_t>(h) * G;
          for (int g = 0; g < G; g++) {
            const float* qh = qp + ((first + g) * L + l) * D;
            for (int d = 0; d < D; d++) scaled[static_cast<size_t>(g) * D + d] = qh[d] * scale;
          }
          attend(scaled.data(), G, D, keys.at(b, h), keys.step(), values.at(b, h), values.step(),
                 Dv, visible + b * mask_row + l * mask_token, mask_step, S, scores.data(),
                 out.data());
          for (int g = 0; g < G; g++) {
            const size_t head = static_cast<size_t>(h) * G + g;
            const size_t at = merged ? ((static_cast<size_t>(b) * L + l) * H + head) * Dv
                                     : ((first + g) * L + l) * Dv;
            std::copy_n(out.data() + static_cast<size_t>(g) * Dv, Dv, op + at);
          }
        }
      }, /*align=*/1);  // a query token's KV head a unit: no blocks of 4 to keep
    });
  }
  const char* name() const override { return "RowsAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RowsAttention&>(other);
    return scale_ == o.scale_ && merged_ == o.merged_;
  }

 private:
  float scale_;
  bool merged_;
};

void check_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                     const mx::array& mask) {
  check_float32({q, k, v});
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || mask.ndim() != 4 ||
      mask.dtype() != mx::bool_)
    throw std::invalid_argument(
        "attention_rows: expected q [B, H, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] and a "
        "bool mask [B, 1, L, S]");
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2), Hkv = k.shape(1), S = k.shape(2);
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != S ||
      k.shape(3) != q.shape(3) || Hkv == 0 || H % Hkv != 0 || S == 0 || L == 0 ||
      mask.shape() != mx::Shape{B, 1, L, S})
    throw std::invalid_argument(
        "attention_rows: expected q [B, H, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with H a "
        "multiple of Hkv, and a bool mask [B, 1, L, S]");
}

mx::array attention_rows(const mx::array& q, const mx::array& k, const mx::array& v,
                         const mx::array& mask, float scale) {
  check_attention(q, k, v, mask);
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2);
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({B, H, L, v.shape(3)}, mx::float32, std::make_shared<RowsAttention>(s, scale),
                   {q, k, v, mask});
}

// attention_rows' output as the output projection reads it, [B, L, H * Dv]: written so by the
// primitive, where [B, H, L, Dv] would take a transpose and a reshape (two more operations).
mx::array attention_rows_merged(const mx::array& q, const mx::array& k, const mx::array& v,
                                const mx::array& mask, float scale) {
  check_attention(q, k, v, mask);
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2);
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({B, L, H * v.shape(3)}, mx::float32,
                   std::make_shared<RowsAttention>(s, scale, /*merged=*/true), {q, k, v, mask});
}

// softmax(where(mask, scores, lowest)) over the last axis of scores [..., S]: the middle of
// MLX's CPU attention (`cpu_attention`), whose where, max, exp, sum and scaling are five passes
// over the scores on one thread, in one pass a row on the pool's threads. Each row's steps are
// MLX's, in its order (a sequential sum, MLX's exp), so the results are MLX's to the bit. The
// scores' buffer is reused when nothing else holds it. mask: bool, the scores' shape (a
// broadcast view reads in place).
class MaskedSoftmax : public CpuPrimitive {
 public:
  explicit MaskedSoftmax(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& scores = inputs[0];
    const auto& mask = inputs[1];
    auto& out = outputs[0];
    const bool in_place = scores.flags().row_contiguous && scores.is_donatable();
    if (in_place)
      out.copy_shared_buffer(scores);
    else
      out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(scores);
    encoder.set_input_array(mask);
    encoder.set_output_array(out);
    const int ndim = scores.ndim(), S = scores.shape(-1);
    const int rows = static_cast<int>(scores.size() / S);
    mx::Shape shape = scores.shape();
    mx::Strides mask_strides = mask.strides();
    encoder.dispatch([source = RowMajor(scores), visible = mask.data<bool>(), op = out.data<float>(),
                      shape, mask_strides, ndim, S, rows, in_place,
                      softmax = g_softmax.load()]() mutable {
      const float* sp = in_place ? op : source.get();
      const int64_t mask_step = mask_strides[ndim - 1];
      parallel_rows(rows, 16, [&](int r0, int r1) {
        for (int r = r0; r < r1; r++) {
          int64_t at = 0;  // the row's first mask flag: its index over the leading axes
          for (int axis = ndim - 2, rest = r; axis >= 0; axis--) {
            at += static_cast<int64_t>(rest % shape[axis]) * mask_strides[axis];
            rest /= shape[axis];
          }
          const float* in = sp + static_cast<size_t>(r) * S;
          float* row = op + static_cast<size_t>(r) * S;
          const bool* flags = visible + at;
          for (int s = 0; s < S; s++) row[s] = flags[s * mask_step] ? in[s] : kLowestScore;
          softmax(row, 1, S);
        }
      }, /*align=*/1);
    });
  }
  const char* name() const override { return "MaskedSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

 private:
  static constexpr float kLowestScore = -std::numeric_limits<float>::max();  // MLX's finfo.min
};

mx::array masked_softmax(const mx::array& scores, const mx::array& mask) {
  if (scores.dtype() != mx::float32 || scores.ndim() < 1 || scores.shape(-1) == 0 ||
      mask.dtype() != mx::bool_ || mask.shape() != scores.shape())
    throw std::invalid_argument(
        "masked_softmax: expected float32 scores [..., S] and a bool mask of the same shape");
  if (g_softmax.load() == nullptr)
    throw std::invalid_argument("masked_softmax: the CPU lacks AVX2 and FMA");
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(scores.shape(), mx::float32, std::make_shared<MaskedSoftmax>(s),
                   {scores, mask});
}

mx::array rms_norm_rows(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 ||
      weight.ndim() != 1 || weight.shape(0) != x.shape(-1) || x.shape(-1) == 0)
    throw std::invalid_argument("rms_norm_rows: expected float32 x [..., D] and weight [D]");
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RowsRMSNorm>(s, eps), {x, weight});
}

mx::array rope_rows(const mx::array& x, const mx::array& offset, int dims, bool traditional,
                    float base, float scale) {
  if (x.dtype() != mx::float32 || x.ndim() != 4 || dims <= 0 || dims % 2 != 0 ||
      dims > x.shape(3))
    throw std::invalid_argument("rope_rows: expected float32 x [B, N, T, D] and even dims <= D");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && static_cast<int>(offset.size()) != x.shape(0)))
    throw std::invalid_argument("rope_rows: expected an int32 offset, one or one per row");
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RowsRoPE>(s, dims, traditional, base, scale), {x, offset});
}

#endif  // ROWS_KERNELS_ONLY
}  // namespace

#ifndef ROWS_KERNELS_ONLY
// Whether every value of each array is finite (neither NaN nor infinite): float32, float16 or
// bfloat16 arrays, evaluated and row-contiguous; a value is not finite when its exponent's bits
// are all set. One call for all of an adapter's tensors, with the GIL held throughout: a load
// that runs beside the decoding threads does not queue for the GIL again after each tensor.
template <typename Bits>
bool finite_bits(const Bits* p, size_t n, Bits exponent) {
  Bits seen = 0;  // a lane's exponent bits where every one of them was set: none, if finite
  for (size_t i = 0; i < n; i++) seen |= static_cast<Bits>(~p[i] & exponent) == 0 ? 1 : 0;
  return seen == 0;
}

std::vector<bool> all_finite(const std::vector<mx::array>& arrays) {
  std::vector<bool> out;
  out.reserve(arrays.size());
  for (auto a : arrays) {
    a.eval();
    if (!a.flags().row_contiguous)
      throw std::invalid_argument("all_finite: the arrays must be row-contiguous");
    const size_t n = a.size();
    if (a.dtype() == mx::float32)
      out.push_back(finite_bits<uint32_t>(a.data<uint32_t>(), n, 0x7f800000u));
    else if (a.dtype() == mx::float16)
      out.push_back(finite_bits<uint16_t>(a.data<uint16_t>(), n, 0x7c00u));
    else if (a.dtype() == mx::bfloat16)
      out.push_back(finite_bits<uint16_t>(a.data<uint16_t>(), n, 0x7f80u));
    else
      throw std::invalid_argument("all_finite: float32, float16 or bfloat16 arrays only");
  }
  return out;
}

// Each float32 array rounded to float16 into a new row-major array, with whether every rounded
// value is finite (values past float16's range become infinite). The rounding is MLX's own
// (mlx::core::float16_t, the code astype runs on this CPU), so the bits are astype's; one call
// for all of an adapter's tensors, with the GIL held throughout, and nothing queued on MLX's
// stream behind the decoding steps. A 2-D array may be strided (a PEFT pair's transpose).
std::tuple<std::vector<mx::array>, std::vector<bool>> to_half(
    const std::vector<mx::array>& arrays) {
  std::vector<mx::array> out;
  std::vector<bool> finite;
  out.reserve(arrays.size());
  finite.reserve(arrays.size());
  for (auto a : arrays) {
    a.eval();
    if (a.dtype() != mx::float32)
      throw std::invalid_argument("to_half: float32 arrays only");
    const bool flat = a.flags().row_contiguous;
    if (!flat && a.ndim() != 2)
      throw std::invalid_argument("to_half: the arrays must be row-contiguous or 2-D");
    mx::array half(mx::allocator::malloc(a.size() * sizeof(uint16_t)), a.shape(), mx::float16);
    uint16_t* h = half.data<uint16_t>();
    const float* x = a.data<float>();
    auto round = [h](size_t i, float value) { h[i] = mx::float16_t(value).bits_; };
    if (flat) {
      for (size_t i = 0; i < a.size(); i++) round(i, x[i]);
    } else {
      const int rows = a.shape(0), cols = a.shape(1);
      const int64_t s0 = a.strides()[0], s1 = a.strides()[1];
      for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
          round(static_cast<size_t>(i) * cols + j, x[i * s0 + j * s1]);
    }
    finite.push_back(finite_bits<uint16_t>(h, a.size(), 0x7c00u));
    out.push_back(std::move(half));
  }
  return {std::move(out), std::move(finite)};
}

NB_MODULE(_rows_matmul, m) {
  m.doc() =
      "The projections and attention of a batched decode step's few rows, and the norms and "
      "RoPE of every step, on the CPU";
  m.def("rows_matmul", &rows_matmul, "x"_a, "w"_a);
  m.def("rows_matmul_lora", &rows_matmul_lora, "x"_a, "w"_a, "a_t"_a, "b_t"_a, "mask"_a);
  m.def("quant_matmul", &quant_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a);
  nb::class_<AdapterPairs>(m, "AdapterPairs",
                           "One adapter's pairs at each LoRA slot, as the gathered kernels read "
                           "them");
  nb::class_<RowPlan>(m, "RowPlan", "A batch's adapters and each row's entries");
  m.def("adapter_pairs", &adapter_pairs, "pairs"_a);
  m.def("row_plan", &row_plan, "adapters"_a, "offsets"_a, "entries"_a, "scales"_a);
  m.def("quant_matmul_heads", &quant_matmul_heads, "x"_a, "ws"_a, "scales"_a, "biases"_a,
        "heads"_a, "group_size"_a, "bits"_a, "plan"_a.none() = nb::none(),
        "slots"_a = std::vector<int>{});
  m.def("quant_matmul_gather", &quant_matmul_gather, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "plan"_a, "slot"_a);
  m.def("all_finite", &all_finite, "arrays"_a);
  m.def("to_half", &to_half, "arrays"_a);
  m.def("rms_norm_rows", &rms_norm_rows, "x"_a, "weight"_a, "eps"_a);
  m.def("rope_rows", &rope_rows, "x"_a, "offset"_a, "dims"_a, "traditional"_a, "base"_a,
        "scale"_a);
  m.def("attention_rows", &attention_rows, "q"_a, "k"_a, "v"_a, "mask"_a, "scale"_a);
  m.def("attention_rows_merged", &attention_rows_merged, "q"_a, "k"_a, "v"_a, "mask"_a,
        "scale"_a);
  m.def("masked_softmax", &masked_softmax, "scores"_a, "mask"_a);
  m.def("set_threads", &set_threads, "threads"_a, "The threads of every later product.");
  m.def("isa", [] { return std::string(g_isa); }, "The vector instructions the kernel uses.");
  m.def(
      "use_isa",
      [](const std::string& name) {
        const Kernel* kernel = name.empty() ? nullptr : find_kernel(name);
        if (kernel == nullptr) return false;
        g_kernel = kernel->range, g_attend = kernel->attend, g_softmax = kernel->softmax;
        g_quant = kernel->quant, g_gather = kernel;
        g_isa = kernel->isa;
        return true;
      },
      "name"_a,
      "Use the avx512vbmi, avx512, avx2 or neon kernel for later products; False if the CPU "
      "lacks it.");
}
#endif  // ROWS_KERNELS_ONLY
