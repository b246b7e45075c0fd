// RowsMatmul: `x @ w.T` for the few rows of a batched decode step, with or without each row's
// LoRA residual.
//
// BLAS packs the whole weight matrix on every call whatever the row count, so eight rows cost
// three times one. Here each weight row is read from memory once, straight into registers, and
// multiplied by every row of x while it is there (the kernel's `range`, kernels/matmul.h). Each
// output is one dot product summed in a fixed order, so a row's result does not depend on the
// other rows of the batch.
//
// x: [..., K] float32 (M rows), w: [N, K] float32 (a Linear's weight), out: [..., N]. With LoRA
// (rows_matmul_lora): out = x @ w.T + ((x @ a_t.T) * mask) @ b_t.T, each row with its own scales
// in `mask` [..., R] (M rows), in the same pass: the low-rank columns extend every dot product,
// so a batch of rows with different adapters costs one primitive per projection.
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "primitives/common.h"
#include "primitives/ops.h"
#include "thread_pool.h"

namespace hotlora {
namespace {

class RowsMatmul : public CpuPrimitive {
 public:
  explicit RowsMatmul(mx::Stream stream) : CpuPrimitive(stream) {}

  // inputs: x [..., K], w; with LoRA also a_t [R, K], b_t [N, R], mask [..., R].
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), N = inputs[1].shape(0);
    const int R = inputs.size() == 5 ? inputs[2].shape(0) : 0;
    dispatch_rows(stream(), inputs, inputs.size(), outputs[0],
                  [M, N, K, R, kernel = active_kernel()->range](auto& operands, float* op) {
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

// x [..., K] against w [N, K]: out [..., N].
mx::array rows_primitive(std::vector<mx::array> inputs) {
  const auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return mx::array(shape, mx::float32, std::make_shared<RowsMatmul>(s), std::move(inputs));
}

}  // namespace

mx::array rows_matmul(const mx::array& x, const mx::array& w) {
  check_float32({x, w});
  if (w.ndim() != 2 || x.shape(-1) != w.shape(1))
    throw std::invalid_argument("rows_matmul: expected x [..., K] and w [N, K]");
  return rows_primitive({x, w});
}

mx::array rows_matmul_lora(const mx::array& x, const mx::array& w, const mx::array& a_t,
                           const mx::array& b_t, const mx::array& mask) {
  check_float32({x, w, a_t, b_t, mask});
  const auto K = x.shape(-1), N = w.shape(0), R = a_t.shape(0);
  const auto M = x.size() / K;
  if (w.ndim() != 2 || a_t.ndim() != 2 || b_t.ndim() != 2 || w.shape(1) != K || a_t.shape(1) != K ||
      b_t.shape(0) != N || b_t.shape(1) != R || mask.shape(-1) != R || mask.size() != M * R)
    throw std::invalid_argument(
        "rows_matmul_lora: expected x [..., K] (M rows), w [N, K], a_t [R, K], b_t [N, R], "
        "mask [..., R] (M rows)");
  return rows_primitive({x, w, a_t, b_t, mask});
}

}  // namespace hotlora
