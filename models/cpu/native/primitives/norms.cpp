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
#include "primitives/rms_norm.h"
#include "primitives/rope.h"

namespace hotlora {
namespace {

// x * rsqrt(mean(x^2) + eps) * weight over the last axis of x [..., D]; weight [D]
// (primitives/rms_norm.h).
class RowsRMSNorm : public CpuPrimitive {
 public:
  RowsRMSNorm(mx::Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int D = inputs[0].shape(-1), M = static_cast<int>(inputs[0].size() / D);
    dispatch_rows(stream(), inputs, 2, outputs[0], [M, D, eps = eps_](auto& operands, float* op) {
      const float* xp = operands[0].get();
      const float* wp = operands[1].get();
      for (int m = 0; m < M; m++)
        rms_norm_row(xp + static_cast<size_t>(m) * D, wp, D, eps, op + static_cast<size_t>(m) * D);
    });
  }
  const char* name() const override { return "RowsRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RowsRMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

// Rotary position embedding of x [B, N, T, D] at positions (offset[b] + t) * scale, as
// mx.fast.rope (primitives/rope.h).
class RowsRoPE : public CpuPrimitive {
 public:
  RowsRoPE(mx::Stream stream, Rope rope) : CpuPrimitive(stream), rope_(rope) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int B = x.shape(0), N = x.shape(1), T = x.shape(2), D = x.shape(3);
    const RopeOffsets offset(inputs[1]);  // one per row, or one for all
    dispatch_rows(stream(), inputs, 1, outputs[0],
                  [=, rope = rope_, inv_freqs = rope_.frequencies()](auto& operands, float* op) {
      rope.apply(operands[0].get(), op, B, N, T, D, offset, inv_freqs);
    });
  }
  const char* name() const override { return "RowsRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return rope_ == static_cast<const RowsRoPE&>(other).rope_;
  }

 private:
  Rope rope_;
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
                   std::make_shared<RowsRoPE>(s, Rope{dims, traditional, base, scale}),
                   {x, offset});
}

}  // namespace hotlora
