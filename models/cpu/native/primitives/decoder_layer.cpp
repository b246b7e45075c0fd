// A llama model's decoder layers' decode step as one primitive (DecoderLayers): the calls a
// step of each fused layer (models/cpu/fused.py) makes, one task where each layer took eleven
// primitives; what a layer's steps share (DecoderOperands) checked once, where it is first
// stepped.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lora_plans.h"
#include "primitives/attention.h"
#include "primitives/common.h"
#include "primitives/ops.h"
#include "primitives/products.h"
#include "primitives/rope.h"

namespace hotlora {
namespace {

// The layer's four calls of products, in order, and how many weights each computes together.
constexpr int kCalls = DecoderOperands::kCalls;
constexpr int kWeights[kCalls] = {3, 1, 2, 1};  // q k v; o; gate up; down
constexpr int kProjections = DecoderOperands::kProjections;
constexpr int kCallOf[kProjections] = {0, 0, 0, 1, 2, 2, 3};
constexpr int kFirst[kCalls] = {0, 3, 4, 6};  // each call's first projection

// A KV cache's keys or values with this step's rows written in: the input's buffer where MLX
// would let an update take it over (as SliceUpdate does), else a row-major copy made in the task.
struct CacheWrite {
  const float* from;
  float* to;
  mx::Shape shape;
  mx::Strides strides;  // the input's
  bool copy;

  CacheWrite(const mx::array& in, mx::array& out)
      : from(in.data<float>()), shape(in.shape()), strides(in.strides()) {
    copy = !(in.flags().row_contiguous && in.is_donatable());
    if (copy)
      out.set_data(mx::allocator::malloc(out.nbytes()));
    else
      out.copy_shared_buffer(in);
    to = out.data<float>();
  }

  // In the task: the copy where there is one, then rows [B, H, 1, D] in at position `at`.
  void write(const float* rows, int at) const {
    const int B = shape[0], H = shape[1], S = shape[2], D = shape[3];
    if (copy)
      for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
          for (int s = 0; s < S; s++) {
            const float* in = from + b * strides[0] + h * strides[1] + s * strides[2];
            float* o = to + ((static_cast<size_t>(b) * H + h) * S + s) * D;
            for (int d = 0; d < D; d++) o[d] = in[d * strides[3]];
          }
    for (int b = 0; b < B; b++)
      for (int h = 0; h < H; h++)
        std::copy_n(rows + (static_cast<size_t>(b) * H + h) * D, D,
                    to + ((static_cast<size_t>(b) * H + h) * S + at) * D);
  }
};

// One decode step (one token a row) of mlx-lm's llama decoder layer with its fused sublayers:
//   q, k, v = rope(norm1(x) @ [Wq, Wk, Wv])    (QuantMatmulHeads with norm and rope)
//   cache[:, :, at] = k, v                     (two SliceUpdates)
//   h = x + attention(q, cache[:, :, :at + 1]) @ Wo
//   out = h + swiglu(norm2(h) @ [Wg, Wu]) @ Wd
// each part computed by the same code as the primitive that computes it alone (HeadsProducts,
// attend_rows), in the same order, so the bits are those of the eleven primitives; a row's
// adapters' residuals added where the plan's slots say, as there. The calls are the operands'
// (made once, `decoder_operands`); what is the step's alone (the cache's outputs given their
// buffers) is made in the primitive's eval_cpu, and run in its task.
struct LayerStep {
  const DecoderOperands* o;  // held by the task
  CacheWrite key_cache, value_cache;
  CacheView keys, values;

  // The layer's keys and values `keys_in` and `values_in`, which come out in `keys_out` and
  // `values_out`.
  LayerStep(const DecoderOperands& operands, const mx::array& keys_in, const mx::array& values_in,
            mx::array& keys_out, mx::array& values_out)
      : o(&operands),
        key_cache(keys_in, keys_out),
        value_cache(values_in, values_out),
        keys(keys_out),
        values(values_out) {}

  // In the task: x [B, 1, D] -> op [B, 1, D] (op is not x), the step's keys and values written;
  // `slots`: the layer's projections' LoRA slots in `plan` (empty: none apply).
  void run(const Kernel* kernel, const float* xp, float* op, int B, int at, const KeyMask& mask,
           const RowPlan* plan, std::span<const int> slots, RopeOffsets positions) {
    const int D = o->D, F = o->F, Dk = o->Dk, Dv = o->Dv, H = o->heads, Hkv = o->kv_heads;
    const auto rows = [&](int c) {
      return HeadsProducts::CallRows{
          plan, slots.empty() ? slots : slots.subspan(kFirst[c], kWeights[c]), positions};
    };
    const float* norm1 = o->arrays[3 * kProjections].data<float>();
    const float* norm2 = o->arrays[3 * kProjections + 1].data<float>();
    std::vector<float> q(static_cast<size_t>(B) * H * Dk), k(static_cast<size_t>(B) * Hkv * Dk),
        v(static_cast<size_t>(B) * Hkv * Dv);
    o->calls[0].run(kernel, xp, norm1, B, 1, D, rows(0), {q.data(), k.data(), v.data()});
    key_cache.write(k.data(), at);
    value_cache.write(v.data(), at);
    std::vector<float> attended(static_cast<size_t>(B) * H * Dv);
    keys.prepare(), values.prepare();
    attend_rows(kernel->attend, q.data(), B, H, 1, Dk, keys, values, Hkv, at + 1, Dv, mask,
                o->scale, /*merged=*/true, attended.data());
    const size_t n = static_cast<size_t>(B) * D;
    std::vector<float> h(n), activated(static_cast<size_t>(B) * F);
    o->calls[1].run(kernel, attended.data(), nullptr, B, 1, H * Dv, rows(1), {h.data()});
    for (size_t i = 0; i < n; i++) h[i] = xp[i] + h[i];  // the residual stream: MLX's Add
    o->calls[2].run(kernel, h.data(), norm2, B, 1, D, rows(2), {activated.data()});
    o->calls[3].run(kernel, activated.data(), nullptr, B, 1, F, rows(3), {op});
    for (size_t i = 0; i < n; i++) op[i] = h[i] + op[i];
  }
};

// A decode step of a run of decoder layers (a model's, or one) as one primitive: each layer's
// LayerStep in turn, in one task, each taking the one before's output; the cache's keys and
// values of each come out as outputs: the inputs' buffers taken over where MLX would let an
// update take them (row-contiguous, nothing else holding them), else copies.
class DecoderLayers : public CpuPrimitive {
 public:
  struct Settings {
    std::vector<std::shared_ptr<const DecoderOperands>> layers;
    int at;
    std::shared_ptr<const RowPlan> plan;
    std::vector<std::vector<int>> slots;  // each layer's projections' LoRA slots (-1: none), or
                                          // empty for a layer where none apply

    bool operator==(const Settings& o) const {
      return layers == o.layers && at == o.at && plan == o.plan && slots == o.slots;
    }
  };

  DecoderLayers(mx::Stream stream, Settings settings)
      : CpuPrimitive(stream), settings_(std::move(settings)) {}

  // inputs: x [B, 1, D]; each layer's keys [B, Hkv, S, Dk] and values [B, Hkv, S, Dv]; mask
  // [B, 1, 1, at + 1] bool; positions int32. outputs: the last layer's [B, 1, D], then each
  // layer's keys and values. The layers' weights and norms are not inputs: their operands hold
  // them, evaluated (`decoder_operands`), and the task holds the operands while it runs. MLX
  // gives each output a copy of the inputs' list, and a model's weights would be ~700 inputs.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Settings& s = settings_;
    const auto& x = inputs[0];
    const int B = x.shape(0), D = x.shape(2);
    const auto& positions = inputs.back();
    // Each output holds a list of the inputs of its own (MLX's make_arrays), and the cache's arrays
    // can be taken over only when held once: the other outputs' lists, which MLX drops unread
    // once this returns, go now.
    for (auto& output : outputs)
      if (&output.inputs() != &inputs) output.inputs().clear();
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    std::vector<LayerStep> steps;
    steps.reserve(s.layers.size());
    for (size_t l = 0; l < s.layers.size(); l++)
      steps.emplace_back(*s.layers[l], inputs[1 + 2 * l], inputs[2 + 2 * l], outputs[1 + 2 * l],
                         outputs[2 + 2 * l]);
    // `held`: the operands, whose arrays and calls the steps read, for as long as the task runs.
    queue_task(stream(), [held = s.layers, plan = s.plan, slots = s.slots, source = RowMajor(x),
                          steps = std::move(steps), mask = KeyMask(inputs[inputs.size() - 2]),
                          positions = RopeOffsets(positions), op = out.data<float>(), B, D,
                          at = s.at, kernel = active_kernel()]() mutable {
      const float* xp = source.get();
      std::vector<float> between[2];  // the layers' outputs before the last, in turn
      for (size_t l = 0; l < steps.size(); l++) {
        float* to = op;
        if (l + 1 < steps.size()) {
          between[l % 2].resize(static_cast<size_t>(B) * D);
          to = between[l % 2].data();
        }
        steps[l].run(kernel, xp, to, B, at, mask, plan.get(),
                     slots.empty() ? std::span<const int>() : std::span<const int>(slots[l]),
                     positions);
        xp = to;
      }
    });
  }
  const char* name() const override { return "DecoderLayers"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return settings_ == static_cast<const DecoderLayers&>(other).settings_;
  }

 private:
  Settings settings_;
};

void check_shape(bool fits, const char* what) {
  if (!fits) throw std::invalid_argument(std::string("decoder layers: expected ") + what);
}

}  // namespace

std::shared_ptr<DecoderOperands> decoder_operands(
    const std::vector<mx::array>& ws, const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases, const std::vector<int>& bits,
    const std::vector<int>& groups, const std::vector<int>& int8, const mx::array& norm1,
    const mx::array& norm2, float eps1, float eps2, int heads, int kv_heads, float scale,
    int rope_dims, bool rope_traditional, float rope_base, float rope_scale) {
  check_shape(ws.size() == kProjections && scales.size() == kProjections &&
                  biases.size() == kProjections && bits.size() == kProjections &&
                  groups.size() == kCalls && int8.size() == kCalls,
              "the weights, scales, biases and bits of q, k, v, o, gate, up and down, and the "
              "groups and int8 of their four calls");
  check_shape(norm1.ndim() == 1 && norm1.shape(0) > 0, "float32 norm weights [D]");
  const int D = norm1.shape(0);
  for (const auto* norm : {&norm1, &norm2})
    check_shape(norm->dtype() == mx::float32 && norm->shape() == mx::Shape{D},
                "float32 norm weights [D]");
  check_shape(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "heads a multiple of the KV heads");
  check_shape(ws[0].ndim() == 2 && ws[2].ndim() == 2 && ws[4].ndim() == 2 &&
                  ws[0].shape(0) % heads == 0 && ws[2].shape(0) % kv_heads == 0,
              "q [H * Dk] and v [Hkv * Dv] rows");
  auto o = std::make_shared<DecoderOperands>();
  o->D = D, o->F = ws[4].shape(0), o->heads = heads, o->kv_heads = kv_heads;
  o->Dk = ws[0].shape(0) / heads, o->Dv = ws[2].shape(0) / kv_heads;
  check_shape(rope_dims > 0 && rope_dims % 2 == 0 && rope_dims <= o->Dk,
              "even RoPE dims up to the head's width");
  const int rows[kProjections] = {
      heads * o->Dk, kv_heads * o->Dk, kv_heads * o->Dv, D, o->F, o->F, D};
  const int inputs[kProjections] = {D, D, D, heads * o->Dv, D, D, o->F};
  std::copy_n(rows, kProjections, o->rows);
  std::copy_n(inputs, kProjections, o->inputs);
  for (int p = 0; p < kProjections; p++) {
    const int c = kCallOf[p];
    check_packed(inputs[p], ws[p], scales[p], biases[p], groups[c], bits[p], int8[c]);
    check_shape(ws[p].shape(0) == rows[p],
                "q [H * Dk], k [Hkv * Dk], v [Hkv * Dv], o [D], gate and up [F], down [D] rows");
    if (p > 0 && kCallOf[p - 1] == c && int8[c])
      check_shape(reads_halves(ws[p], bits[p]) == reads_halves(ws[p - 1], bits[p - 1]),
                  "one order of x's int8 codes a call: MLX's 4-bit packing for all or none");
    check_shape(int8[c] == 0 || int8[c] == 1 || int8[c] == 3,
                "int8 parts a value of 0 (float32 products), 1 or 3");
    check_shape(!int8[c] || inputs[p] <= 65536, "inputs up to 65536 wide on int8 activations");
    o->arrays.insert(o->arrays.end(), {ws[p], scales[p], biases[p]});
  }
  o->arrays.insert(o->arrays.end(), {norm1, norm2});
  // A step reads them where the operands hold them, not as its inputs: they must be there, as
  // the steps read them.
  check_shape(std::all_of(o->arrays.begin(), o->arrays.end(),
                          [](const mx::array& a) { return a.is_available(); }),
              "evaluated weights, scales, biases and norms");
  check_shape(norm1.flags().row_contiguous && norm2.flags().row_contiguous,
              "row-contiguous norm weights");
  o->rows8 = std::any_of(ws.begin(), ws.end(), [](const mx::array& w) {
    return w.dtype() == mx::uint8 || w.dtype() == mx::int8;
  });
  std::copy_n(bits.begin(), kProjections, o->bits);
  for (int c = 0; c < kCalls; c++) o->group[c] = groups[c], o->int8[c] = int8[c];
  o->scale = scale;
  for (int c = 0, p = 0; c < kCalls; c++) {
    HeadsProducts& call = o->calls[c];
    for (int j = 0; j < kWeights[c]; j++, p++) {
      const mx::array* w = &o->arrays[3 * p];
      const int H = c == 0 ? (p == 0 ? heads : kv_heads) : 0;
      call.add(packed_weight(w[0], w[1], w[2], inputs[p], bits[p], groups[c], "decoder_layers"),
               rows[p], H);
    }
    call.group = groups[c], call.int8 = int8[c];
  }
  o->calls[0].rope = Rope{rope_dims, rope_traditional, rope_base, rope_scale};
  o->calls[0].roped = 2, o->calls[0].inv_freqs = o->calls[0].rope.frequencies();
  o->calls[0].norm_eps = eps1;
  o->calls[2].norm_eps = eps2, o->calls[2].glu = true;
  return o;
}

mx::array decoder_layers(const mx::array& x,
                         const std::vector<std::shared_ptr<DecoderOperands>>& layers,
                         const std::vector<mx::array*>& keys, const std::vector<mx::array*>& values,
                         int at, const mx::array& mask, const mx::array& positions,
                         std::shared_ptr<RowPlan> plan, std::vector<std::vector<int>> slots,
                         int layers_a_call) {
  const size_t L = layers.size();
  check_shape(L > 0 && keys.size() == L && values.size() == L,
              "a layer's operands, keys and values for each layer, one layer or more");
  check_shape(layers_a_call > 0, "one layer or more a primitive");
  // The kernel is the active one when the step runs, which may not be the one the operands were
  // checked under (`use_isa` between steps).
  const Kernel* kernel = active_kernel();
  check_shape(kernel != nullptr, "an active kernel");
  check_shape(slots.empty() || slots.size() == L, "each layer's LoRA slots, or none");
  check_shape(x.ndim() == 3 && x.dtype() == mx::float32 && x.shape(1) == 1, "x float32 [B, 1, D]");
  const int B = x.shape(0);
  check_shape(mask.dtype() == mx::bool_ && mask.shape() == mx::Shape{B, 1, 1, at + 1},
              "a bool mask [B, 1, 1, at + 1]");
  check_shape(positions.dtype() == mx::int32 && positions.ndim() == 1 &&
                  (positions.size() == 1 || static_cast<int>(positions.size()) == B),
              "int32 positions, one or one per row");
  if (!plan) slots.clear();
  // Every layer checked before any primitive is made: a refused call changes no cache.
  for (size_t l = 0; l < L; l++) {
    check_shape(layers[l] != nullptr && keys[l] != nullptr && values[l] != nullptr,
                "a layer's operands, keys and values");
    const DecoderOperands& o = *layers[l];
    const mx::array &k = *keys[l], &v = *values[l];
    if (o.rows8 && kernel->int8_rows8 == nullptr)
      throw std::invalid_argument(
          "decoder_layers: the active kernel does not read the layer's weights (rows "
          "interleaved by eight are read by the integer products of a kernel that has them)");
    check_shape(x.shape(2) == o.D, "x [B, 1, D] as wide as every layer's norms");
    check_shape(k.ndim() == 4 && v.ndim() == 4 && k.dtype() == mx::float32 &&
                    v.dtype() == mx::float32 && k.shape(0) == B && v.shape(0) == B &&
                    k.shape(1) == o.kv_heads && v.shape(1) == o.kv_heads &&
                    k.shape(2) == v.shape(2) && 0 <= at && at < k.shape(2),
                "float32 keys [B, Hkv, S, Dk] and values [B, Hkv, S, Dv] with room at `at`");
    check_shape(
        k.shape(3) == o.Dk && v.shape(3) == o.Dv,
        "a cache of the layer's heads: keys Dk and values Dv wide, as q's and v's rows say");
    if (!slots.empty()) {
      check_shape(slots[l].empty() || slots[l].size() == kProjections,
                  "a LoRA slot for each of q, k, v, o, gate, up and down, or none, a layer");
      for (size_t p = 0; p < slots[l].size(); p++)
        if (slots[l][p] >= 0)
          check_plan("decoder_layers", B, o.inputs[p], o.rows[p], *plan, slots[l][p]);
    }
  }
  const auto s = mx::default_stream(mx::Device::cpu);
  mx::array out = x;
  std::vector<mx::array> written;  // each layer's keys and values after the step
  for (size_t first = 0; first < L; first += layers_a_call) {
    const size_t last = std::min(L, first + layers_a_call);
    std::vector<mx::array> inputs{out};
    std::vector<mx::Shape> shapes{x.shape()};
    std::vector<std::shared_ptr<const DecoderOperands>> held;
    std::vector<std::vector<int>> held_slots;
    for (size_t l = first; l < last; l++) {
      inputs.insert(inputs.end(), {*keys[l], *values[l]});
      shapes.insert(shapes.end(), {keys[l]->shape(), values[l]->shape()});
      held.push_back(layers[l]);
      if (!slots.empty()) held_slots.push_back(std::move(slots[l]));
    }
    inputs.insert(inputs.end(), {mask, positions});
    auto outs = mx::array::make_arrays(
        std::move(shapes), std::vector<mx::Dtype>(1 + 2 * (last - first), mx::float32),
        std::make_shared<DecoderLayers>(
            s, DecoderLayers::Settings{std::move(held), at, plan, std::move(held_slots)}),
        std::move(inputs));
    out = outs[0];
    written.insert(written.end(), outs.begin() + 1, outs.end());
  }
  // The cache's arrays become the updated ones in place, as `keys[...] = k` makes them; the
  // primitives hold the arrays they were.
  for (size_t l = 0; l < L; l++) {
    keys[l]->overwrite_descriptor(written[2 * l]);
    values[l]->overwrite_descriptor(written[2 * l + 1]);
  }
  return out;
}

}  // namespace hotlora
