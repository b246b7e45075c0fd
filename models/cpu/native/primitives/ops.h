// The operations the extension exposes, each building one MLX primitive of primitives/*.cpp
// (bindings.cpp binds them by these names).
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <vector>

#include "lora_plans.h"
#include "mlx/array.h"
#include "primitives/products.h"
#include "primitives/rope.h"

namespace hotlora {

namespace mx = mlx::core;

// primitives/rows_matmul.cpp: x [..., K] @ w [N, K].T for a batched decode step's few rows, with
// or without each row's masked LoRA residual ((x @ a_t.T) * mask) @ b_t.T.
mx::array rows_matmul(const mx::array& x, const mx::array& w);
mx::array rows_matmul_lora(const mx::array& x, const mx::array& w, const mx::array& a_t,
                           const mx::array& b_t, const mx::array& mask);

// primitives/quant_matmul.cpp: x @ dequantize(w, scales, biases).T for MLX's affine-quantized
// weights, any number of rows; with each row's own adapters at a LoRA slot (a plan's); several
// weights of one input as one primitive (each of its own bits). `int8`: x's rows quantized to int8
// in blocks of 32, that many parts a value (1 or 3), and integer products
// (kernels/int8_matmul.h); 0: float32 products.
mx::array quant_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                       const mx::array& biases, int group_size, int bits, int int8);
mx::array quant_matmul_gather(const mx::array& x, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits,
                              std::shared_ptr<RowPlan> plan, int slot, int int8);
std::vector<mx::array> quant_matmul_heads(
    const mx::array& x, const std::vector<mx::array>& ws, const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases, const std::vector<int>& heads, int group_size,
    const std::vector<int>& bits, std::shared_ptr<RowPlan> plan, std::vector<int> slots, int int8,
    std::optional<mx::array> offset, int roped, int rope_dims, bool rope_traditional,
    float rope_base, float rope_scale, std::optional<mx::array> norm, float norm_eps, bool glu);

// primitives/decoder_layer.cpp: what a llama decoder layer's decode steps share, checked once
// (`decoder_operands`): its packed q, k, v, o, gate, up and down projections (each one's bits;
// their four calls' groups and int8), its norms, its attention's heads and scale, its RoPE.
// Made and shared from C++ alone (enable_shared_from_this, as RowPlan): the primitive that holds
// it drops it where a step ran without taking the GIL.
struct DecoderOperands : std::enable_shared_from_this<DecoderOperands> {
  static constexpr int kProjections = 7, kCalls = 4;
  std::vector<mx::array> arrays;  // w, scales and biases of each projection, then the two norms
  int bits[kProjections], group[kCalls];
  int int8[kCalls];  // each call's int8 parts a value of x (0: float32 products)
  bool rows8;        // some weight's rows interleaved by eight: the kernel's int8_rows8 reads them
  int D, F, heads, kv_heads, Dk, Dv;             // Dk, Dv: a head's keys and values
  int rows[kProjections], inputs[kProjections];  // each projection's N and K
  float scale;
  // The layer's four calls of products (q k v; o; gate up; down) with their weights' operands,
  // norms and RoPE, as every step runs them: a step brings its rows' plan, slots and positions.
  std::array<HeadsProducts, kCalls> calls;
};
std::shared_ptr<DecoderOperands> decoder_operands(
    const std::vector<mx::array>& ws, const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases, const std::vector<int>& bits,
    const std::vector<int>& groups, const std::vector<int>& int8, const mx::array& norm1,
    const mx::array& norm2, float eps1, float eps2, int heads, int kv_heads, float scale,
    int rope_dims, bool rope_traditional, float rope_base, float rope_scale);

// One decode step (x [B, 1, D]) of such layers, one after another, each with its KV cache (this
// step's keys and values written at `at`), attention and residual stream, to the bits of the
// primitives that compute each part alone, a row's adapters' residuals added where `plan` and
// each layer's `slots` say (as quant_matmul_heads adds them), a primitive (DecoderLayers) for
// each `layers_a_call` of them; returns the last layer's output, and makes each layer's `keys`
// and `values` its cache's arrays after the write, in place, as `keys[...] = k` makes them.
// Every layer is checked before anything is made: a refused call changes nothing.
mx::array decoder_layers(const mx::array& x,
                         const std::vector<std::shared_ptr<DecoderOperands>>& layers,
                         const std::vector<mx::array*>& keys, const std::vector<mx::array*>& values,
                         int at, const mx::array& mask, const mx::array& positions,
                         std::shared_ptr<RowPlan> plan, std::vector<std::vector<int>> slots,
                         int layers_a_call);

// primitives/embedding.cpp: rows `ids` (any shape) of a packed 4- or 8-bit layer, in MLX's
// packing or interleaved by eight (weights.interleave_rows8), dequantized as mx.dequantize
// dequantizes them, to the bit: an embedding's lookup, one primitive.
mx::array packed_lookup(const mx::array& ids, const mx::array& w, const mx::array& scales,
                        const mx::array& biases, int group_size, int bits);

// primitives/norms.cpp: MLX's RMSNorm and RoPE to the bit, each one primitive.
mx::array rms_norm_rows(const mx::array& x, const mx::array& weight, float eps);
mx::array rope_rows(const mx::array& x, const mx::array& offset, int dims, bool traditional,
                    float base, float scale);

// primitives/logits.cpp: each row of logits [B, V] (float32): [B, 2] uint32, the first index of
// its largest value (mx.argmax's where the row holds no NaN) and 1 where every value is finite,
// else 0.
mx::array rows_argmax(const mx::array& logits);

// primitives/attention.cpp: each query token's attention over its own keys, [B, H, L, Dv] or
// merged [B, L, H * Dv]; a prefill chunk's masked softmax.
mx::array attention_rows(const mx::array& q, const mx::array& k, const mx::array& v,
                         const mx::array& mask, float scale);
mx::array attention_rows_merged(const mx::array& q, const mx::array& k, const mx::array& v,
                                const mx::array& mask, float scale);
mx::array masked_softmax(const mx::array& scores, const mx::array& mask);
// A decode step's bool mask [B, 1, 1, span] for attention_rows: row b sees keys s >=
// left_padding[b] (int32 [B]; every key without it), mlx-lm's causal mask of a step, one
// primitive.
mx::array step_key_mask(int batch, int span, const std::optional<mx::array>& left_padding);

}  // namespace hotlora
