// Attention on the CPU: RowsAttention (each query token's attention over its own keys, the
// active Kernel's `attend`, kernels/attention.h) and MaskedSoftmax (a prefill chunk's softmax,
// its `softmax`).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "mlx/ops.h"
#include "primitives/attention.h"
#include "primitives/common.h"
#include "primitives/ops.h"
#include "thread_pool.h"

namespace hotlora {
namespace {

// softmax(q * scale . k^T over the keys the mask shows) . v, each query token on its own: a
// batched decode step's attention, each row on its own keys, in one primitive where MLX's CPU
// backend takes about twenty; with the quantized weights' kernels, every step's (a request
// alone, a prompt's chunks), so that a token's result does not depend on the other rows of the
// batch or on how its prompt was cut into chunks. q [B, H, L, D]; k [B, Hkv, S, D] and
// v [B, Hkv, S, Dv], views of a KV cache; mask [B, 1, L, S] bool (a broadcast view reads in
// place). Query head h reads KV head h / (H / Hkv), as MLX groups them.
class RowsAttention : public CpuPrimitive {
 public:
  // merged: the output as [B, L, H * Dv], the heads side by side (`attention_rows_merged`).
  RowsAttention(mx::Stream stream, float scale, bool merged = false)
      : CpuPrimitive(stream), scale_(scale), merged_(merged) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    const int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
    const int Hkv = inputs[1].shape(1), S = inputs[1].shape(2), Dv = inputs[2].shape(3);
    dispatch_rows(stream(), inputs, 1, outputs[0],
                  [=, scale = scale_, merged = merged_, keys = CacheView(inputs[1]),
                   values = CacheView(inputs[2]), mask = KeyMask(inputs[3]),
                   attend = active_kernel()->attend](auto& operands, float* op) mutable {
      keys.prepare(), values.prepare();
      attend_rows(attend, operands[0].get(), B, H, L, D, keys, values, Hkv, S, Dv, mask, scale,
                  merged, op);
    });
  }
  const char* name() const override { return "RowsAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RowsAttention&>(other);
    return scale_ == o.scale_ && merged_ == o.merged_;
  }

 private:
  float scale_;
  bool merged_;
};

void check_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                     const mx::array& mask) {
  check_float32({q, k, v});
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || mask.ndim() != 4 ||
      mask.dtype() != mx::bool_)
    throw std::invalid_argument(
        "attention_rows: expected q [B, H, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] and a "
        "bool mask [B, 1, L, S]");
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2), Hkv = k.shape(1), S = k.shape(2);
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != S ||
      k.shape(3) != q.shape(3) || Hkv == 0 || H % Hkv != 0 || S == 0 || L == 0 ||
      mask.shape() != mx::Shape{B, 1, L, S})
    throw std::invalid_argument(
        "attention_rows: expected q [B, H, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with H a "
        "multiple of Hkv, and a bool mask [B, 1, L, S]");
}

// softmax(where(mask, scores, lowest)) over the last axis of scores [..., S]: the middle of
// MLX's CPU attention (`cpu_attention`), whose where, max, exp, sum and scaling are five passes
// over the scores on one thread, in one pass a row on the pool's threads. Each row's steps are
// MLX's, in its order (a sequential sum, MLX's exp), so the results are MLX's to the bit. The
// scores' buffer is reused when nothing else holds it. mask: bool, the scores' shape (a
// broadcast view reads in place).
class MaskedSoftmax : public CpuPrimitive {
 public:
  explicit MaskedSoftmax(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& scores = inputs[0];
    const auto& mask = inputs[1];
    auto& out = outputs[0];
    const bool in_place = scores.flags().row_contiguous && scores.is_donatable();
    if (in_place)
      out.copy_shared_buffer(scores);
    else
      out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(scores);
    encoder.set_input_array(mask);
    encoder.set_output_array(out);
    const int ndim = scores.ndim(), S = scores.shape(-1);
    const int rows = static_cast<int>(scores.size() / S);
    mx::Shape shape = scores.shape();
    mx::Strides mask_strides = mask.strides();
    queue_task(stream(), [source = RowMajor(scores), visible = mask.data<bool>(),
                          op = out.data<float>(), shape, mask_strides, ndim, S, rows, in_place,
                          softmax = active_kernel()->softmax]() mutable {
      const float* sp = in_place ? op : source.get();
      const int64_t mask_step = mask_strides[ndim - 1];
      const auto body = [&](int r0, int r1) {
        for (int r = r0; r < r1; r++) {
          int64_t at = 0;  // the row's first mask flag: its index over the leading axes
          for (int axis = ndim - 2, rest = r; axis >= 0; axis--) {
            at += static_cast<int64_t>(rest % shape[axis]) * mask_strides[axis];
            rest /= shape[axis];
          }
          const float* in = sp + static_cast<size_t>(r) * S;
          float* row = op + static_cast<size_t>(r) * S;
          const bool* flags = visible + at;
          for (int s = 0; s < S; s++) row[s] = flags[s * mask_step] ? in[s] : kLowestScore;
          softmax(row, 1, S);
        }
      };
      parallel_rows(rows, 16, body, /*align=*/1);
    });
  }
  const char* name() const override { return "MaskedSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

 private:
  static constexpr float kLowestScore = -std::numeric_limits<float>::max();  // MLX's finfo.min
};

// A decode step's attention mask [B, 1, 1, S]: row b sees the keys from its left padding on
// (all of them without one), what mlx-lm's causal mask of one query token at the cache's last
// position gives (create_causal_mask: nine operations).
class StepKeyMask : public CpuPrimitive {
 public:
  explicit StepKeyMask(mx::Stream stream) : CpuPrimitive(stream) {}

  // inputs: none, or the rows' left padding (int32 [B]).
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int B = outputs[0].shape(0), S = outputs[0].shape(3);
    const int32_t* padding = inputs.empty() ? nullptr : inputs[0].data<int32_t>();
    const int64_t stride = inputs.empty() ? 0 : inputs[0].strides()[0];
    dispatch_rows<bool>(stream(), inputs, 0, outputs[0], [padding, stride, B, S](auto&, bool* op) {
      for (int b = 0; b < B; b++) {
        const int64_t first = padding ? padding[b * stride] : 0;
        for (int s = 0; s < S; s++) op[static_cast<size_t>(b) * S + s] = s >= first;
      }
    });
  }
  const char* name() const override { return "StepKeyMask"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// The most scores a unit of `attend_rows` keeps (its tokens' G heads by S positions): a prompt
// chunk's tokens are taken as many at once as fit (and as leave each thread of the pool a few
// units), so that each block of keys and values in the core's cache serves them all
// (kernels/attention.h, kKeyBlock). A 4,000-token prompt of the embedded model in the server's
// chunks, with AVX2's whole-vector sums of scores and the masks read once a block: 13.1-14.3 ->
// 12.1-12.6 s as AVX2, 10.2-11.0 s either way with AVX-512's kernels; 1, 2 and 4 MiB alike.
constexpr size_t kScoreBytes = size_t(1) << 20;
constexpr int kQueryTile = 4;  // the most tokens of a tile of `attend` (kTileTokens<1>)

// The query tokens of a unit: as many tiles as kScoreBytes of scores hold, at most a share of the
// chunk that leaves every thread of the pool a few units to take.
int query_block(int B, int Hkv, int L, int G, int S) {
  const size_t per_token = static_cast<size_t>(G) * S * sizeof(float);
  const int fits = static_cast<int>(std::max<size_t>(1, kScoreBytes / per_token / kQueryTile));
  const int wanted = std::max(1, 4 * pool_threads() / std::max(1, B * Hkv));  // units a head
  const int tiles = (L + kQueryTile - 1) / kQueryTile;
  return kQueryTile * std::clamp((tiles + wanted - 1) / wanted, 1, fits);
}

}  // namespace

void attend_rows(Attend attend, const float* q, int B, int H, int L, int D, const CacheView& keys,
                 const CacheView& values, int Hkv, int S, int Dv, const KeyMask& mask, float scale,
                 bool merged, float* op) {
  const int G = H / Hkv;
  const int block = query_block(B, Hkv, L, G, S);
  const int blocks = (L + block - 1) / block;  // a prompt chunk's tokens, `block` at a time
  const auto body = [&](int u0, int u1) {
    const size_t most = static_cast<size_t>(block) * G;  // query vectors of a unit
    // Each thread's scratch, kept from call to call (up to kScoreBytes of scores and the unit's
    // queries and outputs): a prompt's every layer would otherwise allocate and clear it.
    thread_local std::vector<float> scratch;
    scratch.resize(std::max(scratch.size(), most * (D + S + Dv)));
    float* scaled = scratch.data();
    float* scores = scaled + most * D;
    float* out = scores + most * S;
    for (int u = u0; u < u1; u++) {
      const int b = u / (Hkv * blocks), h = u / blocks % Hkv, l0 = u % blocks * block;
      const int T = std::min(block, L - l0);
      const size_t first = static_cast<size_t>(b) * H + static_cast<size_t>(h) * G;
      for (int t = 0; t < T; t++)
        for (int g = 0; g < G; g++) {
          const float* qh = q + ((first + g) * L + l0 + t) * D;
          float* to = scaled + (static_cast<size_t>(t) * G + g) * D;
          for (int d = 0; d < D; d++) to[d] = qh[d] * scale;
        }
      attend(scaled, T, G, D, keys.at(b, h), keys.step(), values.at(b, h), values.step(), Dv,
             mask.visible + b * mask.row + l0 * mask.token, mask.step, mask.token, S, scores, out);
      for (int t = 0; t < T; t++)
        for (int g = 0; g < G; g++) {
          const size_t head = static_cast<size_t>(h) * G + g, l = static_cast<size_t>(l0 + t);
          const size_t at = merged ? ((static_cast<size_t>(b) * L + l) * H + head) * Dv
                                   : ((first + g) * L + l) * Dv;
          std::copy_n(out + (static_cast<size_t>(t) * G + g) * Dv, Dv, op + at);
        }
    }
  };
  parallel_rows(B * Hkv * blocks, 1, body, /*align=*/1);
}

mx::array attention_rows(const mx::array& q, const mx::array& k, const mx::array& v,
                         const mx::array& mask, float scale) {
  check_attention(q, k, v, mask);
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2);
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({B, H, L, v.shape(3)}, mx::float32, std::make_shared<RowsAttention>(s, scale),
                   {q, k, v, mask});
}

// attention_rows' output as the output projection reads it, [B, L, H * Dv]: written so by the
// primitive, where [B, H, L, Dv] would take a transpose and a reshape (two more operations).
mx::array attention_rows_merged(const mx::array& q, const mx::array& k, const mx::array& v,
                                const mx::array& mask, float scale) {
  check_attention(q, k, v, mask);
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2);
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({B, L, H * v.shape(3)}, mx::float32,
                   std::make_shared<RowsAttention>(s, scale, /*merged=*/true), {q, k, v, mask});
}

mx::array step_key_mask(int batch, int span, const std::optional<mx::array>& left_padding) {
  if (batch <= 0 || span <= 0)
    throw std::invalid_argument("step_key_mask: expected one row or more and one key or more");
  if (left_padding && (left_padding->dtype() != mx::int32 || left_padding->ndim() != 1 ||
                       left_padding->shape(0) != batch))
    throw std::invalid_argument("step_key_mask: expected the rows' left padding as int32 [B]");
  const auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs;
  if (left_padding) inputs.push_back(*left_padding);
  return mx::array({batch, 1, 1, span}, mx::bool_, std::make_shared<StepKeyMask>(s),
                   std::move(inputs));
}

mx::array masked_softmax(const mx::array& scores, const mx::array& mask) {
  if (scores.dtype() != mx::float32 || scores.ndim() < 1 || scores.shape(-1) == 0 ||
      mask.dtype() != mx::bool_ || mask.shape() != scores.shape())
    throw std::invalid_argument(
        "masked_softmax: expected float32 scores [..., S] and a bool mask of the same shape");
  if (active_kernel() == nullptr)
    throw std::invalid_argument("masked_softmax: the CPU lacks AVX2 and FMA");
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(scores.shape(), mx::float32, std::make_shared<MaskedSoftmax>(s), {scores, mask});
}

}  // namespace hotlora
