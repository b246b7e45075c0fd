// The kernels' operands and signatures: what every ISA's kernels take and kernels/table.h lists.
// Nothing here or elsewhere under kernels/ needs MLX or nanobind: tests/native/kernels_check.cpp
// builds the kernels alone.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace hotlora {

constexpr int kPrefetch = 512;  // floats ahead of the weight rows being read

// How far past the weight rows being multiplied the integer kernels ask for the codes that
// follow (kernels/int8_matmul.h). A step of a row or a few streams every weight from memory
// once, and the hardware's prefetch, seeing R rows read side by side, falls behind: asked for
// ahead, a one-row step's products on the embedded model's layers take ~28% less time on the
// AVX2 machine (the same bits: nothing is computed otherwise). The float kernels, bound by
// their arithmetic, gain nothing from it; the exact products of packed weights do
// (kernels/quant_matmul.h's prefetch_groups).
constexpr int kPrefetchBytes = 2048;
// The same for the rows interleaved by eight (kernels/int8_matmul.h's int8_rows8_range), one
// stream of bytes that their kernel reads about twice as fast: asked for 2,048 bytes ahead, a
// one-row step's products on the embedded model's layers took 6.9-7.6 ms on the AVX2 machine;
// 4,096 ahead, 4.6-5.7 ms (8,192: 5.2).
constexpr int kRows8PrefetchBytes = 4096;
// The interleaved products' weight codes a tile (kernels/int8_matmul.h's int8_rows8_range): what
// every P rows of a prompt's x read again, kept to a part of a core's L2.
constexpr int kRows8TileBytes = 256 << 10;

// Ask for `bytes` from `at`, a cache line at a time: what one step of a block's loop reads, in
// the rows ahead.
inline void prefetch_ahead(const uint8_t* at, int bytes) {
  for (int line = 0; line < bytes; line += 64) __builtin_prefetch(at + line);
}

// Whether the LoRA's kernels ask for their adapters' values ahead (kernels/lora_gather.h's
// kResidualsAhead, kLowRankAhead): everywhere but on AMD's family 17h (Zen to Zen 2), whose
// hardware prefetch follows those streams by itself and does better without the asks. 16 rows
// of 16 distinct rank-16 float16 adapters on the embedded model, a Zen 2 EPYC (AVX2), runs
// minutes apart: the residuals' passes 7.6-7.8 ms a step without the asks against 8.5-8.6 with
// them (float32 adapters 12.2-12.9 against 14.3-15.1, one adapter on every row 3.8-3.9 against
// 4.2-4.3); an Intel Xeon (AVX-512 VNNI) took 11.0-11.2 ms with them against 13.3 without.
inline bool lora_asks_ahead() {
#if defined(__x86_64__)
  static const bool asks = !__builtin_cpu_is("amdfam17h");
  return asks;
#else
  return true;
#endif
}

// Scratch of n values of T that stays with this thread from one call to the next (one buffer
// for each `Tag`), or, while another holds that one, a buffer of its own. A prompt chunk's
// scratch is megabytes, past the size from which glibc maps each allocation of its own (as
// models/cpu/__init__.py sets it, so that freed memory goes back): made afresh at every call,
// each of its pages was faulted in and zeroed again, a tenth of a prefill. Its values are
// whatever the last call left: the caller writes before it reads.
template <typename T, typename Tag>
class Reused {
 public:
  explicit Reused(size_t n) {
    Kept& kept = this_thread();
    if (kept.busy) {
      own_.resize(n);
      data_ = own_.data();
      return;
    }
    kept.busy = true;
    if (kept.values.size() < n) kept.values.resize(n);
    data_ = kept.values.data();
    kept_ = &kept;
  }
  ~Reused() {
    if (kept_ != nullptr) kept_->busy = false;
  }
  Reused(const Reused&) = delete;
  Reused& operator=(const Reused&) = delete;
  T* data() const { return data_; }

 private:
  struct Kept {
    std::vector<T> values;
    bool busy = false;
  };
  static Kept& this_thread() {
    thread_local Kept kept;
    return kept;
  }
  Kept* kept_ = nullptr;
  std::vector<T> own_;
  T* data_ = nullptr;
};

// One pair of operands of a sum of products: rows of x [M, k] and of w [N, k], row-major.
struct Seg {
  const float* x = nullptr;
  const float* w = nullptr;
  int k = 0;  // 0: no operands
  Seg rows(int m, int n) const {
    return k ? Seg{x + static_cast<size_t>(m) * k, w + static_cast<size_t>(n) * k, k} : *this;
  }
};

// Weights [N, K] quantized as MLX's affine mode: the packed words, and a scale and a bias a
// group of `group` values in their own dtype (kernels/quant_types.h lists the bits and groups).
struct Quantized {
  const uint32_t* w = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
  int K = 0, bits = 4, group = 32;
  int dtype = 0;  // 0: float32, 1: float16, 2: bfloat16
  // Codes with rows interleaved by eight (kernels/int8_matmul.h's int8_rows8_range), read by
  // the integer products only; else MLX's packing, a row after another. At 8 bits the codes
  // are stored as q - 128 (`signed_codes`, int8); at 5 and 6 bits in bit planes above 4 bits.
  bool rows8 = false;
  bool signed_codes = false;
};

// The bit planes above the codes' low four bits in rows interleaved by eight (`Quantized::rows8`)
// at `bits`: one at 5 bits, two at 6, none at 4 and 8 (a block of 32 codes of eight rows takes
// 32 * bits bytes either way: the low four bits' 128 and 32 a plane, or the 8-bit codes' 256).
constexpr int rows8_planes(int bits) { return bits < 8 ? bits - 4 : 0; }

// Rows of activations quantized to int8 for the integer products (kernels/int8_matmul.h; made by
// kernels/quantize_rows.h): each row of K values in blocks of 32, the int8 codes of a block and
// its scale d, and for each group of the weights the sum over its blocks of the block's quantized
// values, which the biases multiply, and each block's integer sum of each part's codes. A value
// is one code c (a value ~ d * c, `parts` 1), or three (`parts` 3: d * (c0 + (c1 + c2 / 254) /
// 254), within 0.5 / 254^2 of d's units, about float32's own rounding of the block's largest
// value), each part of a block its 32 codes in turn. For
// MLX's 4-bit packing a block's codes are stored evens first, then odds: the order in which a
// packed byte's low and high halves give the weights' (kernels/quantize_rows.h's `halves_first`).
struct QuantizedRows {
  const int8_t* q = nullptr;            // [M, K / 32, parts, 32]
  const float* d = nullptr;             // [M, K / 32]
  const float* sums = nullptr;          // [M, K / group]
  const int32_t* block_sums = nullptr;  // [M, K / 32, parts]: each part's sum of its codes
  int parts = 1;
  QuantizedRows row(int m, int K, int group) const {
    const size_t blocks = static_cast<size_t>(m) * (K / 32);
    return {q + blocks * 32 * parts, d + blocks, sums + static_cast<size_t>(m) * (K / group),
            block_sums + blocks * parts, parts};
  }
};

// A part's weight in the one before it (QuantizedRows, `parts` 3): 254, so that the remainder of
// a rounding, at most half a unit, times it rounds into [-127, 127].
constexpr float kPartScale = 254.0f;

// out[:, n0:n1] of main.x @ main.w.T (+ extra.x @ extra.w.T); out is [M, N] (kernels/matmul.h).
using Range = void (*)(const Seg& main, const Seg& extra, float* out, int M, int N, int n0, int n1);
// The attention of T query tokens of one row for the query heads that share a KV head
// (kernels/attention.h).
using Attend = void (*)(const float* q, int T, int G, int D, const float* k, int64_t k_step,
                        const float* v, int64_t v_step, int Dv, const bool* visible,
                        int64_t visible_step, int64_t token_step, int S, float* scores, float* out);
// Each of G rows of S scores replaced by its softmax (kernels/attention.h).
using Softmax = void (*)(float* scores, int G, int S);
// out[i] = SiLU(gate[i]) * up[i] for n values, mlx_lm's swiglu (kernels/activations.h); out may
// be up, each value read before it is written.
using Glu = void (*)(const float* gate, const float* up, float* out, int n);
// out[:, n0:n1] of x @ dequantize(q).T, with `tile_floats` floats of scratch at `tile`
// (kernels/quant_matmul.h).
using QuantRange = void (*)(const Quantized& q, const float* x, float* out, int M, int N, int n0,
                            int n1, float* tile, int tile_floats);
// out[:, n0:n1] of x @ dequantize(q).T from x's rows quantized to int8 (kernels/int8_matmul.h).
using Int8Range = void (*)(const Quantized& q, const QuantizedRows& x, float* out, int M, int N,
                           int n0, int n1);
// The gathered LoRA's kernels, for float32 adapters and for float16 ones (T: uint16_t)
// (kernels/lora_gather.h).
// Each call serves 1 to kLoraRows rows of one adapter, its pair read once for all of them.
constexpr int kLoraRows = 4;
template <typename T>
using Residuals = void (*)(const float* const* h, const T* b, int N, const int* columns, int count,
                           float* const* out, int rows, int n0, int n1);
template <typename T>
using LowRank = void (*)(const float* const* x, const T* a, int K, int r, const float* scale,
                         float* const* h, int rows);

}  // namespace hotlora
