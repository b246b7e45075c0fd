// A decode step's greedy tokens: RowsArgmax.
//
// Each row of the logits [B, V]: the first index of its largest value (mx.argmax's choice for a
// row without a NaN, ties to the first) and whether every value is finite, in one pass of one
// primitive, the rows split over the pool's threads: MLX's argmax and a finite check (a row's
// sum) read the logits a value at a time. A row's results are its own values' alone.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "mlx/ops.h"
#include "primitives/common.h"
#include "primitives/ops.h"
#include "thread_pool.h"

namespace hotlora {
namespace {

// Lanes of the maxima and of the finite check: a few vectors a pass, which the compiler keeps
// in registers.
constexpr int kScanLanes = 16;

// Whether a float's exponent bits are all ones: an infinity or a NaN.
inline uint32_t not_finite(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7f800000u) == 0x7f800000u;
}

// out[0]: the first index of the row's largest value (a NaN is never larger, so a row of NaNs
// gives 0, as a row of -inf does); out[1]: 1 if every value is finite, else 0. Each lane keeps
// its largest value and where it first saw it (`v > best`: a later equal value does not move
// it); the row's first index is the least of those lanes' whose value is the row's largest.
void scan_row(const float* __restrict row, int V, uint32_t* out) {
  float best[kScanLanes];
  uint32_t at[kScanLanes] = {}, bad[kScanLanes] = {};
  for (float& b : best) b = -INFINITY;
  int i = 0;
  for (; i <= V - kScanLanes; i += kScanLanes)
    for (int l = 0; l < kScanLanes; l++) {
      const float v = row[i + l];
      const uint32_t larger = -static_cast<uint32_t>(v > best[l]);  // all ones, or none
      best[l] = v > best[l] ? v : best[l];
      at[l] = (at[l] & ~larger) | (static_cast<uint32_t>(i + l) & larger);
      bad[l] |= not_finite(v);
    }
  float most = -INFINITY;
  uint32_t any_bad = 0;
  for (int l = 0; l < kScanLanes; l++) {
    most = best[l] > most ? best[l] : most;
    any_bad |= bad[l];
  }
  const int tail = i;
  for (; i < V; i++) {
    most = row[i] > most ? row[i] : most;
    any_bad |= not_finite(row[i]);
  }
  uint32_t first = UINT32_MAX;  // none: every value -inf or NaN, and mx.argmax takes the first
  if (most != -INFINITY) {
    for (int l = 0; l < kScanLanes; l++)
      if (best[l] == most && at[l] < first) first = at[l];
    for (int j = tail; j < V && first == UINT32_MAX; j++)  // the lanes' indices come first
      if (row[j] == most) first = static_cast<uint32_t>(j);
  }
  out[0] = first == UINT32_MAX ? 0 : first;
  out[1] = any_bad ? 0 : 1;
}

class RowsArgmax : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int B = inputs[0].shape(0), V = inputs[0].shape(1);
    dispatch_rows<uint32_t>(stream(), inputs, 1, outputs[0], [B, V](auto& operands, uint32_t* op) {
      const float* x = operands[0].get();
      const auto rows = [&](int b0, int b1) {
        for (int b = b0; b < b1; b++) scan_row(x + static_cast<size_t>(b) * V, V, op + 2 * b);
      };
      parallel_rows(B, 1, rows, 1);
    });
  }
  const char* name() const override { return "RowsArgmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

mx::array rows_argmax(const mx::array& logits) {
  if (logits.dtype() != mx::float32 || logits.ndim() != 2 || logits.shape(1) == 0)
    throw std::invalid_argument("rows_argmax: expected float32 logits [B, V], V > 0");
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({logits.shape(0), 2}, mx::uint32, std::make_shared<RowsArgmax>(s), {logits});
}

}  // namespace hotlora
