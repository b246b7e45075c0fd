// Rows of float32 activations quantized to int8 for the integer products (kernels/int8_matmul.h):
// plain scalar code, the same on every ISA, so that a row's codes depend on its own values alone,
// never on the kernel, the other rows or the threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/types.h"
#include "primitives/rms_norm.h"

namespace hotlora {

// v rounded to the nearest integer, ties to even, for |v| <= 2^22: adding 1.5 * 2^23 leaves no
// bit below the units, so the sum rounds as the FPU does (to nearest even), and subtracting it
// back is exact. What std::nearbyint gives in the default rounding mode, without a call into libm
// a value.
inline float round_to_int(float v) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return (v + kShift) - kShift;          // not folded: no -ffast-math, so no reassociation
}

// A block's integer sums of its codes' parts (`sums`, `parts` of them) as one value in units of
// d: c0 alone, or c0 + (c1 + c2 / kPartScale) / kPartScale, in that order (the kernels'
// `parts_sum` too).
inline float parts_value(const int32_t* sums, int parts) {
  const float c0 = static_cast<float>(sums[0]);
  if (parts == 1) return c0;
  constexpr float kInverse = 1.0f / kPartScale;
  return std::fma(std::fma(static_cast<float>(sums[2]), kInverse, static_cast<float>(sums[1])),
                  kInverse, c0);
}

// One row x [K] into `out` (QuantizedRows' layout, its row 0, `out.parts` codes a value): each
// block of 32 scaled by its largest magnitude to [-127, 127] and rounded to the nearest (ties to
// even), as llama.cpp's q8 blocks are; with three parts each remainder, times kPartScale, rounded
// again. Each block's integer sum of each part's codes (`block_sums`); each group's sum of its
// quantized values (d * the codes' integer sums, block by block in order), in float32, so that the
// biases multiply the same values the codes do: the product is then that of the quantized row,
// whose errors the weights' own spread around zero keeps small (an exact sum of x beside them would
// leave the codes' errors uncompensated). `halves`: a block's codes evens first, then odds
// (`halves_first`), else in plain order.
inline void quantize_row(const float* x, int K, int group, bool halves, const QuantizedRows& out) {
  const int parts = out.parts;
  int8_t* q = const_cast<int8_t*>(out.q);
  float* d = const_cast<float*>(out.d);
  int32_t* block_sums = const_cast<int32_t*>(out.block_sums);
  for (int b = 0; b < K / 32; b++) {
    const float* xb = x + static_cast<size_t>(b) * 32;
    float largest = 0.0f;  // std::max: fmax's value here (a NaN left out), without a libm call
    float probe = 0.0f;    // NaN where a value is infinite or NaN (x * 0), else 0
    for (int i = 0; i < 32; i++) {
      largest = std::max(largest, std::fabs(xb[i]));
      probe += xb[i] * 0.0f;
    }
    // A scale under float32's smallest normal (a block of zeros, or of values near 1e-37) takes
    // every value to code 0: its inverse would overflow. A block holding an infinite or NaN
    // value gets the scale NaN and codes 0: the products it enters are NaN, as the float
    // products would be, not finite values that hide the overflow (a row's logits then tell it).
    const bool finite = probe == 0.0f;
    const float scale = finite ? largest / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const float inverse =
        finite && scale >= std::numeric_limits<float>::min() ? 1.0f / scale : 0.0f;
    d[b] = scale;
    int8_t* qb = q + static_cast<size_t>(b) * 32 * parts;
    int32_t* sums = block_sums + static_cast<size_t>(b) * parts;
    std::fill_n(sums, parts, 0);
    for (int i = 0; i < 32; i++) {
      const int at = halves ? (i % 2) * 16 + i / 2 : i;  // evens, then odds
      float v = finite ? xb[i] * inverse : 0.0f;
      for (int p = 0; p < parts; p++) {
        const float code = round_to_int(v);
        qb[p * 32 + at] = static_cast<int8_t>(code);
        sums[p] += qb[p * 32 + at];   // the stored code's, as the kernels read it
        v = (v - code) * kPartScale;  // v - code exact: code is v's nearest integer
      }
    }
  }
  for (int g = 0; g < K / group; g++) {
    float sum = 0.0f;
    for (int b = g * group / 32; b < (g + 1) * group / 32; b++)
      sum += d[b] * parts_value(block_sums + static_cast<size_t>(b) * parts, parts);
    const_cast<float*>(out.sums)[g] = sum;
  }
}

// Whether the integer products of q read a block's activations evens first, then odds: MLX's
// 4-bit packing, a byte's low half then its high half (kernels/int8_matmul.h).
inline bool halves_first(const Quantized& q) { return q.bits == 4 && !q.rows8; }

// M rows of x [M, K] quantized, held for the products that read them: `quantize` fills rows
// [m0, m1), so that threads may share the rows. With `norm` (its weight [K]) each row is
// RMS-normalized first (rms_norm_row, the bits of a normalized copy), one row at a time on the
// thread that quantizes it, into `normed` [M, K] where the caller reads the normalized rows too
// (a LoRA's activations), else into a row of scratch.
class Int8Rows {
 public:
  Int8Rows(const float* x, int M, int K, int group, bool halves, int parts,
           const float* norm = nullptr, float eps = 0.0f, float* normed = nullptr)
      : x_(x),
        norm_(norm),
        normed_(normed),
        eps_(eps),
        K_(K),
        group_(group),
        halves_(halves),
        parts_(parts),
        q_(static_cast<size_t>(M) * K * parts),
        d_(static_cast<size_t>(M) * (K / 32)),
        sums_(static_cast<size_t>(M) * (K / group)),
        block_sums_(static_cast<size_t>(M) * (K / 32) * parts) {}
  Int8Rows(const Int8Rows&) = delete;
  Int8Rows& operator=(const Int8Rows&) = delete;
  void quantize(int m0, int m1) {
    struct Normed;  // a row normalized, kept on the thread
    const Reused<float, Normed> scratch(norm_ && !normed_ ? K_ : 0);
    for (int m = m0; m < m1; m++) {
      const float* x = x_ + static_cast<size_t>(m) * K_;
      if (norm_) {
        float* row = normed_ ? normed_ + static_cast<size_t>(m) * K_ : scratch.data();
        rms_norm_row(x, norm_, K_, eps_, row);
        x = row;
      }
      quantize_row(x, K_, group_, halves_, rows().row(m, K_, group_));
    }
  }
  QuantizedRows rows() const {
    return {q_.data(), d_.data(), sums_.data(), block_sums_.data(), parts_};
  }

 private:
  const float* x_;
  const float* norm_;
  float* normed_;
  float eps_;
  int K_, group_;
  bool halves_;
  int parts_;
  // Kept on the thread for its next rows (`Reused`).
  struct Codes;
  struct Scales;
  struct Sums;
  struct BlockSums;
  Reused<int8_t, Codes> q_;
  Reused<float, Scales> d_;
  Reused<float, Sums> sums_;
  Reused<int32_t, BlockSums> block_sums_;
};

}  // namespace hotlora
