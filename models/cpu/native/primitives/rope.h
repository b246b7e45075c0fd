// MLX's RoPE (mx.fast.rope) to the bit, for RowsRoPE (primitives/norms.cpp) and for the q and k
// that QuantMatmulHeads (primitives/quant_matmul.cpp) rotates as it writes them: one rounding an
// operation, MLX's own exp, sin and cos, built without FMA as MLX is.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/simd/math.h"

namespace hotlora {

// The rows' first positions an offset array holds (int32, one per row or one for all).
struct RopeOffsets {
  const int32_t* at = nullptr;
  int64_t stride = 0;  // between rows' offsets; 0: one for all

  RopeOffsets() = default;
  explicit RopeOffsets(const mlx::core::array& offset)
      : at(offset.data<int32_t>()), stride(offset.size() == 1 ? 0 : offset.strides()[0]) {}
  int32_t operator[](int b) const { return at[b * stride]; }
};

// A RoPE's settings: the first `dims` features rotated in pairs (i, i + dims / 2), or (2i, 2i + 1)
// when traditional, by angle position * base^(-i / (dims / 2)), positions scaled by `scale`.
struct Rope {
  int dims = 0;  // 0: no rotation
  bool traditional = false;
  float base = 10000.0f;
  float scale = 1.0f;

  bool operator==(const Rope&) const = default;

  // base^(-i / (dims / 2)) for i < dims / 2, as MLX computes them.
  std::vector<float> frequencies() const {
    const int half = dims / 2;
    std::vector<float> inv(half);
    const float step = std::log(base) / half;
    for (int i = 0; i < half; i++)
      inv[i] = mx::simd::exp(mx::simd::Simd<float, 1>(static_cast<float>(-i) * step)).value;
    return inv;
  }

  // x [B, N, T, D] rotated into `out` (which may be x) at positions (offset[b] + t) * scale.
  void apply(const float* x, float* out, int B, int N, int T, int D, RopeOffsets offset,
             const std::vector<float>& inv_freqs) const {
    const int half = dims / 2;
    std::vector<float> cos_t(half), sin_t(half);
    for (int b = 0; b < B; b++) {
      for (int t = 0; t < T; t++) {
        const int32_t start = offset[b];
        const float position = (static_cast<float>(t) + static_cast<float>(start)) * scale;
        for (int i = 0; i < half; i++) {
          const float theta = position * inv_freqs[i];
          cos_t[i] = mx::simd::cos(mx::simd::Simd<float, 1>(theta)).value;
          sin_t[i] = mx::simd::sin(mx::simd::Simd<float, 1>(theta)).value;
        }
        for (int n = 0; n < N; n++) {
          const size_t row = ((static_cast<size_t>(b) * N + n) * T + t) * D;
          const float* in = x + row;
          float* o = out + row;
          for (int i = 0; i < half; i++) {  // a pair read whole before either is written
            const int i1 = traditional ? 2 * i : i, i2 = traditional ? 2 * i + 1 : i + half;
            const float x1 = in[i1], x2 = in[i2];
            const float x1c = x1 * cos_t[i], x2s = x2 * sin_t[i];
            const float x1s = x1 * sin_t[i], x2c = x2 * cos_t[i];
            o[i1] = x1c - x2s;
            o[i2] = x1s + x2c;
          }
          if (o != in)
            for (int d = 2 * half; d < D; d++) o[d] = in[d];
        }
      }
    }
  }
};

}  // namespace hotlora
