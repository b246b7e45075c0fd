// What the products of packed weights share: a weight's operands (`packed_weight`), x's rows
// multiplied by one quantization's weights (`PackedProducts`), and one call of several weights'
// products of one input, with its norm, rotation, activation and LoRA residuals (`HeadsProducts`):
// what QuantMatmul, QuantMatmulGather and QuantMatmulHeads (primitives/quant_matmul.cpp) queue,
// and DecoderLayers (primitives/decoder_layer.cpp) runs four of each layer.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/quantize_rows.h"
#include "kernels/table.h"
#include "lora_plans.h"
#include "mlx/array.h"
#include "primitives/rope.h"
#include "thread_pool.h"

namespace hotlora {

namespace mx = mlx::core;

// A packed weight's operands as the kernel reads them (w [N, K * bits / 32] uint32, or uint8
// [N, K * bits / 8] for rows interleaved by eight, int8 for signed 8-bit codes so interleaved;
// scales and biases [N, K / group]), each row-contiguous, else refused in `name`'s words.
inline Quantized packed_weight(const mx::array& w, const mx::array& scales, const mx::array& biases,
                               int K, int bits, int group, const char* name) {
  for (const auto* a : {&w, &scales, &biases})
    if (!a->flags().row_contiguous)
      throw std::invalid_argument(std::string(name) + ": the weights must be row-contiguous");
  const int dtype = scales.dtype() == mx::float32 ? 0 : scales.dtype() == mx::float16 ? 1 : 2;
  const bool rows8 = w.dtype() == mx::uint8 || w.dtype() == mx::int8;
  return Quantized{
      w.data<uint32_t>(),   scales.data<void>(), biases.data<void>(), K, bits, group, dtype, rows8,
      w.dtype() == mx::int8};
}

// A tile in L1 for the few rows of a decode step; larger ones (L2) for a prompt's many.
inline int tile_floats(int M) { return M <= 16 ? 8192 : 32768; }

// The products of x's M rows by packed weights of one quantization (`group`, `bits`): the active
// kernel's float product (`quant`, kernels/quant_matmul.h) on x as it is (`int8` 0), or its
// integer product (kernels/int8_matmul.h) on x's rows quantized once here, for every weight
// that follows, `int8` int8 parts a value (1: `--cpu-precision fast`; 3: `exact`).
class PackedProducts {
 public:
  // `halves`: the weights' products read x's int8 codes evens first (`halves_first`). `norm`
  // (int8 only): x's rows RMS-normalized by it as they are quantized (Int8Rows), into `normed`
  // [M, K] where it is given.
  PackedProducts(const Kernel* kernel, const float* x, int M, int K, int group, int int8,
                 bool halves, const float* norm = nullptr, float eps = 0.0f,
                 float* normed = nullptr)
      : kernel_(kernel), x_(x), M_(M) {
    if (!int8) return;
    rows_.emplace(x, M, K, group, halves, int8, norm, eps, normed);
    parallel_rows(
        M, 8, [this](int m0, int m1) { rows_->quantize(m0, m1); }, 1);
  }

  // out[:, n0:n1] of x @ dequantize(q).T; out is [M, N]. On any thread of the pool.
  void range(const Quantized& q, float* out, int N, int n0, int n1) const {
    if (q.rows8) return kernel_->int8_rows8(q, rows_->rows(), out, M_, N, n0, n1);
    if (rows_) return kernel_->int8(q, rows_->rows(), out, M_, N, n0, n1);
    const int floats = tile_floats(M_);
    thread_local std::vector<float> tile;
    tile.resize(std::max<size_t>(floats, 4 * static_cast<size_t>(q.K)));
    kernel_->quant(q, x_, out, M_, N, n0, n1, tile.data(), floats);
  }

  // out [M, N] = x @ dequantize(q).T, the columns split over the pool's threads (in multiples of
  // 8, interleaved rows' groups).
  void all(const Quantized& q, float* out, int N) const {
    parallel_rows(
        N, 64, [&](int n0, int n1) { range(q, out, N, n0, n1); }, 8);
  }

 private:
  const Kernel* kernel_;
  const float* x_;
  int M_;
  std::optional<Int8Rows> rows_;
};

// Refuses packed weights the kernels do not take, for inputs K wide: kernels/quant_types.h lists
// the bits and groups; rows interleaved by eight (uint8 or int8 w) go to the integer products
// (`int8`) only. In primitives/quant_matmul.cpp.
void check_packed(int K, const mx::array& w, const mx::array& scales, const mx::array& biases,
                  int group, int bits, int int8);

// Whether a packed weight's integer products read x's int8 codes evens first, then odds
// (`halves_first`): MLX's 4-bit packing, not interleaved.
inline bool reads_halves(const mx::array& w, int bits) {
  return bits == 4 && w.dtype() == mx::uint32;
}

// One call of products of several packed weights on one input x [B, L, K] (M = B * L rows), as
// QuantMatmulHeads' task computes it. Each weight has its own bits, layout of codes and dtype of
// scales (a GGUF's K-quant mix); they share a group size and a precision, and on int8
// activations, quantized once for all of them, one order of x's codes (`reads_halves`). x's
// rows are first normalized where a norm is given, each output's residuals added where it has a
// LoRA slot, then the outputs laid out as heads ([B, H, L, D]) and rotated, or, with `glu`, one
// output SiLU(gate) * up. The weights' operands are resolved (`packed_weight`) where the call is
// built, once for every step where a decoder layer's operands keep it (DecoderOperands); what
// the call's rows bring (`CallRows`) and x and the norm's weight are `run`'s, where the task
// runs.
struct HeadsProducts {
  std::vector<Quantized> weights;
  std::vector<int> widths;      // each output's N
  std::vector<int> offsets{0};  // each output's first column in the concatenated N
  std::vector<int> heads;       // each output's heads; 0: [B, L, N]
  int group = 32;
  int int8 = 0;  // x's int8 parts a value (PackedProducts), 0: float32 products
  Rope rope;
  int roped = 0;  // the first `roped` outputs rotated at the rows' positions (`CallRows`)
  std::vector<float> inv_freqs;
  std::optional<float> norm_eps;  // x's rows RMS-normalized first, by `run`'s `norm` weight
  bool glu = false;

  void add(const Quantized& q, int N, int H) {
    weights.push_back(q);
    widths.push_back(N);
    offsets.push_back(offsets.back() + N);
    heads.push_back(H);
  }

  // What the call's rows bring to it: their adapters' plan and each output's slot in it (-1:
  // none; empty: no residuals), and their positions where outputs are rotated.
  struct CallRows {
    const RowPlan* plan = nullptr;
    std::span<const int> slots;
    RopeOffsets positions;
  };

  // The outputs `outs` (one, with `glu`) of x's M rows, L tokens a row, K wide; `norm`: the
  // norm's weight [K] where `norm_eps` is set. On the stream's thread, the pool's threads under.
  void run(const Kernel* kernel, const float* x, const float* norm, int M, int L, int K,
           const CallRows& rows, const std::vector<float*>& outs) const;
};

}  // namespace hotlora
