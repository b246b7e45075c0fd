// One row's RMSNorm as MLX computes it, shared by RowsRMSNorm and the products that normalize
// their input first (QuantMatmulHeads).
#pragma once

#include <cmath>
#include <cstddef>

namespace hotlora {

// out = x * rsqrt(mean(x^2) + eps) * weight for x [D]: the squares summed in order, as MLX's
// CPU reduction sums them, one rounding an operation (no FMA: the build contracts nothing), so
// the bits are MLX's.
inline void rms_norm_row(const float* x, const float* weight, int D, float eps, float* out) {
  const float inverse_d = static_cast<float>(1.0 / D);  // MLX's mean: the sum times 1 / D
  float sum = 0.0f;
  for (int d = 0; d < D; d++) {
    const float square = x[d] * x[d];
    sum += square;
  }
  const float scale = 1.0f / std::sqrt(sum * inverse_d + eps);
  for (int d = 0; d < D; d++) {
    const float normed = x[d] * scale;
    out[d] = normed * weight[d];
  }
}

}  // namespace hotlora
