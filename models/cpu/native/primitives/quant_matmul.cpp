// The products of packed quantized weights: QuantMatmul (`x @ dequantize(w).T`, any number of
// rows), QuantMatmulGather (with each row's own adapters at a LoRA slot, gathered from a plan)
// and QuantMatmulHeads (several weights of one input as one primitive). The kernels are the
// active Kernel's `quant` (kernels/quant_matmul.h) or, on int8 activations, its `int8`
// (kernels/int8_matmul.h), through PackedProducts, and its gathered LoRA's (RowResiduals).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/quant_types.h"
#include "kernels/quantize_rows.h"
#include "lora_plans.h"
#include "mlx/ops.h"
#include "primitives/common.h"
#include "primitives/ops.h"
#include "primitives/products.h"
#include "primitives/rms_norm.h"
#include "primitives/rope.h"
#include "thread_pool.h"

namespace hotlora {
namespace {

// `x @ dequantize(w, scales, biases).T` for MLX's affine-quantized weights, any number of rows:
// a request alone, a batched decode step, a prefill chunk. The weights stay packed in memory;
// each thread dequantizes a tile of weight rows at a time into a buffer that stays in cache and
// multiplies every row of x by it. Each output is one fixed-order sum over K, so a row's result
// does not depend on the other rows, however many: a batch or a prompt's chunking changes no
// bit. With LoRA, QuantMatmulGather adds each row's own residuals after the same products.
class QuantMatmul : public CpuPrimitive {
 public:
  QuantMatmul(mx::Stream stream, int bits, int group, int int8)
      : CpuPrimitive(stream), bits_(bits), group_(group), int8_(int8) {}

  // inputs: x [..., K], w [N, K * bits / 32] uint32, scales and biases [N, K / group].
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), N = inputs[1].shape(0);
    const Quantized q =
        packed_weight(inputs[1], inputs[2], inputs[3], K, bits_, group_, "quant_matmul");
    dispatch_rows(stream(), inputs, 1, outputs[0],
                  [=, int8 = int8_, kernel = active_kernel()](auto& operands, float* op) {
      PackedProducts(kernel, operands[0].get(), M, K, q.group, int8, halves_first(q)).all(q, op, N);
    });
  }
  const char* name() const override { return "QuantMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmul&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && int8_ == o.int8_;
  }

 private:
  int bits_;
  int group_;
  int int8_;
};

// Refuses what the kernels do not take: kernels/quant_types.h lists the bits and groups; rows
// interleaved by eight (uint8 or int8 w) go to the integer products only.
void check_quantized(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group, int bits, int int8) {
  if (active_kernel() == nullptr)
    throw std::invalid_argument("quant_matmul: the CPU lacks AVX2 and FMA");
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) == 0)
    throw std::invalid_argument("quant_matmul: x must be float32 [..., K]");
  check_packed(x.shape(-1), w, scales, biases, group, bits, int8);
}

}  // namespace

void check_packed(int K, const mx::array& w, const mx::array& scales, const mx::array& biases,
                  int group, int bits, int int8) {
  if (active_kernel() == nullptr)
    throw std::invalid_argument("quant_matmul: the CPU lacks AVX2 and FMA");
  const bool rows8 = w.dtype() == mx::uint8 || w.dtype() == mx::int8;
  if (!quant_bits_served(bits) && !(rows8 && (bits == 5 || bits == 6)))
    throw std::invalid_argument("quant_matmul: " + served_words(quant_bits_array(QuantTypes{})) +
                                " bits only (5 and 6 interleaved by eight)");
  if (!quant_group_served(group))
    throw std::invalid_argument("quant_matmul: groups of " + served_words(kQuantGroups) + " only");
  const auto dtype = scales.dtype();
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16)
    throw std::invalid_argument("quant_matmul: float32, float16 or bfloat16 scales only");
  if (rows8) {
    if ((w.dtype() == mx::int8) != (bits == 8) || !int8 || active_kernel()->int8_rows8 == nullptr ||
        w.ndim() != 2 || w.shape(0) % 8 != 0 || K % group != 0 ||
        static_cast<int64_t>(w.shape(1)) * 8 / bits != K || biases.dtype() != dtype ||
        scales.shape() != mx::Shape{w.shape(0), K / group} || biases.shape() != scales.shape())
      throw std::invalid_argument(
          "quant_matmul: rows interleaved by eight (w [N, K * bits / 8], uint8 at 4, 5 or 6 bits, "
          "int8 for 8-bit codes as signed q - 128, N a multiple of 8) are read by the integer "
          "products (int8) of a kernel that has them, only");
    return;
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || K % group != 0 ||
      static_cast<int64_t>(w.shape(1)) * 32 / bits != K || biases.dtype() != dtype ||
      scales.shape() != mx::Shape{w.shape(0), K / group} || biases.shape() != scales.shape())
    throw std::invalid_argument(
        "quant_matmul: expected x [..., K], w [N, K * bits / 32] uint32 (or interleaved "
        "uint8), and scales and biases [N, K / group] of one dtype");
}

namespace {

// The integer products hold a weight row's scales and biases on the stack: K up to 65536.
void check_int8(const mx::array& x, int int8) {
  if (int8 != 0 && int8 != 1 && int8 != 3)
    throw std::invalid_argument("quant_matmul: int8 takes 0 (float32 products), 1 or 3 parts");
  if (int8 && x.shape(-1) > 65536)
    throw std::invalid_argument("quant_matmul: int8 activations take K up to 65536");
}

mx::array quant_primitive(std::vector<mx::array> inputs, int N, int group, int bits, int int8) {
  const auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = inputs[0].shape();
  shape.back() = N;
  return mx::array(shape, mx::float32, std::make_shared<QuantMatmul>(s, bits, group, int8),
                   std::move(inputs));
}

class QuantMatmulGather : public CpuPrimitive {
 public:
  QuantMatmulGather(mx::Stream stream, int bits, int group, std::shared_ptr<const RowPlan> plan,
                    int slot, int int8)
      : CpuPrimitive(stream),
        bits_(bits),
        group_(group),
        plan_(std::move(plan)),
        slot_(slot),
        int8_(int8) {}

  // inputs: x [..., K] (M rows, M / S a row of the plan), then w, scales, biases as
  // QuantMatmul's; the plan's adapters' pairs at the slot are added.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), N = inputs[1].shape(0);
    const Quantized q =
        packed_weight(inputs[1], inputs[2], inputs[3], K, bits_, group_, "quant_matmul_gather");
    dispatch_rows(stream(), inputs, 1, outputs[0],
                  [=, plan = plan_, slot = slot_, int8 = int8_, kernel = active_kernel()](
                      auto& operands, float* op) {
      const float* xp = operands[0].get();
      RowResiduals residuals(kernel, M, K);
      residuals.add(*plan, slot, N, op);
      PackedProducts(kernel, xp, M, K, q.group, int8, halves_first(q)).all(q, op, N);
      residuals.apply(xp);  // from x as it is, in float32
    });
  }
  const char* name() const override { return "QuantMatmulGather"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmulGather&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && plan_ == o.plan_ && slot_ == o.slot_ &&
           int8_ == o.int8_;
  }

 private:
  int bits_;
  int group_;
  std::shared_ptr<const RowPlan> plan_;
  int slot_;
  int int8_;
};

// x @ dequantize(w_j).T for several weights of one input at once (a layer's q, k and v, or its
// gate and up): one primitive and one pass of the pool's threads where separate products take
// one each. Each output is computed by quant_matmul's kernel on the same rows, so its bits are
// quant_matmul's; an output with a slot adds each row's own adapters' residuals there as
// quant_matmul_gather does (RowResiduals, all the outputs' in one pass), to its bits. x [B, L, K];
// output j is [B, heads_j, L, N_j / heads_j] (the attention's layout, with the reshape and
// transpose that would make it done here), or [B, L, N_j] where heads_j is 0. At L = 1 the two
// layouts are the same bytes; otherwise the products (and residuals) go to a scratch buffer in
// rows' order first. With a `rope`, the first `roped` outputs (a layer's q and k) are then
// rotated in place at their rows' positions, as RowsRoPE rotates them (primitives/rope.h), to its
// bits: the attention's q and k without two more primitives a layer. With a `norm`, x's rows are
// first normalized as RowsRMSNorm does (primitives/rms_norm.h), to its bits: the layer's norm
// before its attention or MLP without a primitive of its own. With `glu`, a gate and an up
// product give one output, mlx_lm's swiglu of the two to its bits: the MLP's activation too.
class QuantMatmulHeads : public CpuPrimitive {
 public:
  // slots[j]: output j's LoRA slot, whose residuals `plan` adds (-1: none; slots is empty when
  // no output has one).
  QuantMatmulHeads(mx::Stream stream, std::vector<int> bits, int group, std::vector<int> heads,
                   std::shared_ptr<const RowPlan> plan, std::vector<int> slots, int int8, Rope rope,
                   int roped, std::optional<float> norm_eps, bool glu)
      : CpuPrimitive(stream),
        bits_(std::move(bits)),
        group_(group),
        heads_(std::move(heads)),
        plan_(std::move(plan)),
        slots_(std::move(slots)),
        int8_(int8),
        rope_(rope),
        roped_(roped),
        norm_eps_(norm_eps),
        glu_(glu) {}

  // inputs: x, then w, scales and biases of each output, then the rows' positions (int32, one
  // per row or one for all) when `roped` > 0, then the norm's weight [K] with a `norm_eps`.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), L = x.shape(1);
    const int count =
        static_cast<int>(inputs.size() - 1 - (roped_ > 0) - norm_eps_.has_value()) / 3;
    HeadsProducts call;
    for (int j = 0; j < count; j++) {
      const int at = 1 + 3 * j;
      call.add(packed_weight(inputs[at], inputs[at + 1], inputs[at + 2], K, bits_[j], group_,
                             "quant_matmul_heads"),
               inputs[at].shape(0), heads_[j]);
    }
    call.group = group_, call.int8 = int8_;
    call.rope = rope_, call.roped = roped_, call.norm_eps = norm_eps_, call.glu = glu_;
    RopeOffsets positions;
    if (roped_ > 0) {
      positions = RopeOffsets(inputs[1 + 3 * count]);
      call.inv_freqs = rope_.frequencies();
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& input : inputs) encoder.set_input_array(input);
    std::vector<float*> outs;
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
      outs.push_back(out.data<float>());
    }
    queue_task(stream(),
               [source = RowMajor(x), norm = norm_eps_ ? RowMajor(inputs.back()) : RowMajor(x),
                call = std::move(call), plan = plan_, slots = slots_, positions, outs, M, L, K,
                kernel = active_kernel()]() mutable {
      call.run(kernel, source.get(), call.norm_eps ? norm.get() : nullptr, M, L, K,
               {plan.get(), slots, positions}, outs);
    });
  }
  const char* name() const override { return "QuantMatmulHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmulHeads&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && heads_ == o.heads_ && plan_ == o.plan_ &&
           slots_ == o.slots_ && int8_ == o.int8_ && rope_ == o.rope_ && roped_ == o.roped_ &&
           norm_eps_ == o.norm_eps_ && glu_ == o.glu_;
  }

 private:
  std::vector<int> bits_;  // each weight's
  int group_;
  std::vector<int> heads_;
  std::shared_ptr<const RowPlan> plan_;
  std::vector<int> slots_;
  int int8_;
  Rope rope_;
  int roped_;
  std::optional<float> norm_eps_;
  bool glu_;
};

}  // namespace

void HeadsProducts::run(const Kernel* kernel, const float* x, const float* norm, int M, int L,
                        int K, const CallRows& rows, const std::vector<float*>& outs) const {
  const int count = static_cast<int>(weights.size());
  // Where each product is written: its output, or scratch [M, N_j] to lay out after (all of
  // them in one buffer, kept on the thread). With `glu`, the gate goes to scratch and up to the
  // one output, which SiLU(gate) * up then overwrites value by value: a prompt chunk's scratch
  // is half the two products (tens of MB on a 1B model's MLP).
  const auto laid_out_after = [&](int j) { return glu ? j == 0 : heads[j] > 0 && L > 1; };
  size_t laid_out = 0;
  for (int j = 0; j < count; j++)
    if (laid_out_after(j)) laid_out += static_cast<size_t>(M) * widths[j];
  struct Products;
  const Reused<float, Products> scratch(laid_out);
  std::vector<float*> products(count);
  for (int j = 0, at = 0; j < count; j++)
    if (laid_out_after(j)) {
      products[j] = scratch.data() + static_cast<size_t>(at) * M;
      at += widths[j];
    } else {
      products[j] = outs[glu ? 0 : j];
    }
  RowResiduals residuals(kernel, M, K);
  for (size_t j = 0; j < rows.slots.size(); j++)
    if (rows.slots[j] >= 0) residuals.add(*rows.plan, rows.slots[j], widths[j], products[j]);
  // x's rows normalized, where a norm comes first: each row as it is quantized to int8, kept
  // where the LoRA's activations read them too; else (the float products) into scratch first,
  // split over the threads as the quantization is.
  const bool kept = norm_eps && !residuals.empty();
  const bool whole = norm_eps && (kept || !int8);  // every normalized row in `normed`
  struct Normed;
  const Reused<float, Normed> normed(whole ? static_cast<size_t>(M) * K : 0);
  if (norm_eps && !int8)
    parallel_rows(
        M, 8,
        [&](int m0, int m1) {
      for (int m = m0; m < m1; m++)
        rms_norm_row(x + static_cast<size_t>(m) * K, norm, K, *norm_eps,
                     normed.data() + static_cast<size_t>(m) * K);
        },
        1);
  const float* xp = whole ? normed.data() : x;
  const PackedProducts packed(kernel, int8 ? x : xp, M, K, group, int8, halves_first(weights[0]),
                              norm_eps && int8 ? norm : nullptr, norm_eps.value_or(0.0f),
                              kept && int8 ? normed.data() : nullptr);  // x quantized once
  parallel_rows(
      offsets.back(), 64,
      [&](int n0, int n1) {
    for (int j = 0; j < count; j++) {
      const int a = std::max(n0, offsets[j]) - offsets[j];
      const int b = std::min(n1, offsets[j + 1]) - offsets[j];
      if (a < b) packed.range(weights[j], products[j], widths[j], a, b);
    }
      },
      8);
  residuals.apply(xp);
  if (glu) {  // the one output: SiLU(gate) * up, each value's own bits whatever the split
    parallel_rows(
        M * widths[0], 1024,
        [&](int i0, int i1) {
      kernel->swiglu(products[0] + i0, outs[0] + i0, outs[0] + i0, i1 - i0);
        },
        16);
    return;
  }
  for (int j = 0; j < count; j++) {
    if (!laid_out_after(j)) continue;
    const int H = heads[j], N = widths[j], D = N / H, B = M / L;
    for (int b = 0; b < B; b++)  // [B, L, H, D] to [B, H, L, D]
      for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++)
          std::copy_n(products[j] + (static_cast<size_t>(b) * L + l) * N + h * D, D,
                      outs[j] + ((static_cast<size_t>(b) * H + h) * L + l) * D);
  }
  for (int j = 0; j < roped; j++) {
    const int H = heads[j], D = widths[j] / H;
    rope.apply(outs[j], outs[j], M / L, H, L, D, rows.positions, inv_freqs);
  }
}

mx::array quant_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                       const mx::array& biases, int group_size, int bits, int int8) {
  check_quantized(x, w, scales, biases, group_size, bits, int8);
  check_int8(x, int8);
  return quant_primitive({x, w, scales, biases}, w.shape(0), group_size, bits, int8);
}

// `quant_matmul(x, w, ...)` plus each row's own adapters' residuals at `slot` (`plan`'s).
mx::array quant_matmul_gather(const mx::array& x, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits,
                              std::shared_ptr<RowPlan> plan, int slot, int int8) {
  check_quantized(x, w, scales, biases, group_size, bits, int8);
  check_int8(x, int8);
  const int N = w.shape(0);
  if (!plan) throw std::invalid_argument("quant_matmul_gather: expected a plan");
  check_plan("quant_matmul_gather", x, N, *plan, slot);
  mx::Shape shape = x.shape();
  shape.back() = N;
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(
      shape, mx::float32,
      std::make_shared<QuantMatmulGather>(s, bits, group_size, std::move(plan), slot, int8),
      {x, w, scales, biases});
}

// `quant_matmul` of x [B, L, K] by each of `ws` (w, scales, biases triplets, each of its own
// `bits`, one group size) as one primitive; output j is [B, heads[j], L, N_j / heads[j]], or [B, L,
// N_j] for heads 0, plus each row's own adapters' residuals at slots[j] where `plan` is given and
// slots[j] >= 0 (slots: one for each output, or empty); the first `roped` outputs rotated by `rope`
// at positions offset[b] + l (offset: int32, one per row or one for all); with a `norm` weight [K],
// x's rows normalized first as rms_norm_rows(x, norm, norm_eps) does, to its bits; with `glu`
// (two outputs of one width, no heads), one output [B, L, N]: SiLU(first) * second (`swiglu`).
std::vector<mx::array> quant_matmul_heads(
    const mx::array& x, const std::vector<mx::array>& ws, const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases, const std::vector<int>& heads, int group_size,
    const std::vector<int>& bits, std::shared_ptr<RowPlan> plan, std::vector<int> slots, int int8,
    std::optional<mx::array> offset, int roped, int rope_dims, bool rope_traditional,
    float rope_base, float rope_scale, std::optional<mx::array> norm, float norm_eps, bool glu) {
  if (ws.empty() || scales.size() != ws.size() || biases.size() != ws.size() ||
      heads.size() != ws.size() || bits.size() != ws.size() ||
      (!slots.empty() && slots.size() != ws.size()))
    throw std::invalid_argument(
        "quant_matmul_heads: expected as many weights, scales, biases, heads, bits and slots (or "
        "none), at least one");
  if (x.ndim() != 3) throw std::invalid_argument("quant_matmul_heads: expected x [B, L, K]");
  check_int8(x, int8);
  if (!plan) slots.clear();
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes;
  const int B = x.shape(0), L = x.shape(1);
  for (size_t j = 0; j < ws.size(); j++) {
    check_quantized(x, ws[j], scales[j], biases[j], group_size, bits[j], int8);
    if (int8 && reads_halves(ws[j], bits[j]) != reads_halves(ws[0], bits[0]))
      throw std::invalid_argument(
          "quant_matmul_heads: on int8 activations the weights must read x's codes in one order: "
          "MLX's 4-bit packing for all of them or for none");
    const int N = ws[j].shape(0), H = heads[j];
    if (H < 0 || (H > 0 && N % H != 0))
      throw std::invalid_argument("quant_matmul_heads: heads must divide the weight's rows");
    shapes.push_back(H > 0 ? mx::Shape{B, H, L, N / H} : mx::Shape{B, L, N});
    inputs.insert(inputs.end(), {ws[j], scales[j], biases[j]});
    if (!slots.empty() && slots[j] >= 0) check_plan("quant_matmul_heads", x, N, *plan, slots[j]);
  }
  if (glu && (ws.size() != 2 || heads[0] != 0 || heads[1] != 0 ||
              ws[0].shape(0) != ws[1].shape(0) || roped > 0))
    throw std::invalid_argument(
        "quant_matmul_heads: glu takes a gate and an up of one width, without heads or rotation");
  if (glu) shapes = {mx::Shape{B, L, ws[0].shape(0)}};
  if (glu && static_cast<int64_t>(B) * L * ws[0].shape(0) > std::numeric_limits<int>::max())
    throw std::invalid_argument("quant_matmul_heads: glu's output holds at most 2^31 - 1 values");
  const Rope rope{rope_dims, rope_traditional, rope_base, rope_scale};
  if (roped < 0 || roped > static_cast<int>(ws.size()))
    throw std::invalid_argument("quant_matmul_heads: roped counts leading outputs");
  if (roped > 0) {
    if (!offset || offset->dtype() != mx::int32 || offset->ndim() != 1 ||
        (offset->size() != 1 && static_cast<int>(offset->size()) != B))
      throw std::invalid_argument(
          "quant_matmul_heads: expected an int32 offset, one or one per row, to rotate by");
    for (int j = 0; j < roped; j++)
      if (heads[j] == 0 || rope_dims <= 0 || rope_dims % 2 != 0 ||
          rope_dims > ws[j].shape(0) / heads[j])
        throw std::invalid_argument(
            "quant_matmul_heads: a rotated output needs heads and even dims <= its head width");
    inputs.push_back(*offset);
  }
  if (norm) {
    if (norm->dtype() != mx::float32 || norm->ndim() != 1 || norm->shape(0) != x.shape(-1))
      throw std::invalid_argument("quant_matmul_heads: expected a float32 norm weight [K]");
    inputs.push_back(*norm);
  }
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(
      std::move(shapes), std::vector<mx::Dtype>(glu ? 1 : ws.size(), mx::float32),
      std::make_shared<QuantMatmulHeads>(s, bits, group_size, heads, std::move(plan),
                                         std::move(slots), int8, rope, roped,
                                         norm ? std::optional<float>(norm_eps) : std::nullopt, glu),
      std::move(inputs));
}

}  // namespace hotlora
