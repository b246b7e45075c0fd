// The norms and RoPEs of every step: RowsRMSNorm and RowsRoPE.
//
// RMSNorm and RoPE, each one primitive: MLX's CPU backend composes them from ten to thirty small
// operations, and at a few rows each costs more to schedule than to compute. Each is MLX's
// composition step for step, in float32 (one rounding an operation, MLX's own exp, sin and
// cos), so its results are MLX's to the bit; this code is built without FMA, as MLX is, so that
// no product and sum are fused into one rounding.
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/simd/math.h"
#include "mlx/ops.h"
#include "primitives/common.h"
#include "primitives/ops.h"

namespace hotlora {
namespace {

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

}  // namespace

mx::array rms_norm_rows(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 ||
      weight.ndim() != 1 || weight.shape(0) != x.shape(-1) || x.shape(-1) == 0)
    throw std::invalid_argument("rms_norm_rows: expected float32 x [..., D] and weight [D]");
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RowsRMSNorm>(s, eps), {x, weight});
}

mx::array rope_rows(const mx::array& x, const mx::array& offset, int dims, bool traditional,
                    float base, float scale) {
  if (x.dtype() != mx::float32 || x.ndim() != 4 || dims <= 0 || dims % 2 != 0 || dims > x.shape(3))
    throw std::invalid_argument("rope_rows: expected float32 x [B, N, T, D] and even dims <= D");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && static_cast<int>(offset.size()) != x.shape(0)))
    throw std::invalid_argument("rope_rows: expected an int32 offset, one or one per row");
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RowsRoPE>(s, dims, traditional, base, scale), {x, offset});
}

}  // namespace hotlora
