// The lookup of an embedding laid out for the interleaved integer kernel (InterleavedLookup).
//
// A packed embedding on int8 activations keeps its codes as `weights.interleave_rows8` lays them
// out (eight rows side by side a block of 32 codes), so that its use as the output layer takes
// the interleaved kernel without a second copy of its weights. Its lookup, composed of MLX's
// operations (picking each id's bytes out of its eight rows', unpacking, packing back as MLX
// packs them, then `mx.dequantize`), was 61 of the 96 nodes of a one-row decode step's graph on
// the embedded model; as one primitive, the step took 4.8-5.2 ms where it took 5.1-6.0 (AVX2
// and VNNI, alternated in one process, the same logits). Its arithmetic is mx.dequantize's: each
// value scale * code + bias in float32, a product then a sum (built without FMA, as MLX is), the
// scales and biases converted to float32 exactly first, so its rows are mx.dequantize's to the
// bit.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "primitives/common.h"
#include "primitives/ops.h"
#include "thread_pool.h"

namespace hotlora {
namespace {

// A scale's or bias's float32 value, from float32, float16 or bfloat16 (dtype 0, 1, 2).
float param(const void* p, size_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  if (dtype == 1) return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
  return static_cast<float>(static_cast<const mx::bfloat16_t*>(p)[i]);
}

// The ids' values in row-major order, int32, uint32 or int64, from their array as laid out
// (any strides), read where the task runs.
struct Ids {
  const void* data;
  mx::Shape shape;
  mx::Strides strides;
  mx::Dtype dtype;

  explicit Ids(const mx::array& ids)
      : data(ids.data<void>()), shape(ids.shape()), strides(ids.strides()), dtype(ids.dtype()) {}

  int64_t operator[](int64_t m) const {
    int64_t at = 0;
    for (int axis = static_cast<int>(shape.size()) - 1; axis >= 0; axis--) {
      at += (m % shape[axis]) * strides[axis];
      m /= shape[axis];
    }
    if (dtype == mx::int32) return static_cast<const int32_t*>(data)[at];
    if (dtype == mx::uint32) return static_cast<const uint32_t*>(data)[at];
    return static_cast<const int64_t*>(data)[at];
  }
};

// What a lookup reads: the layer's N rows of K codes at `bits` (4, or 8: uint8, or int8 whose
// codes are the bytes' values + 128), interleaved by eight, and their scales and biases [N, K /
// group] laid out by eights as interleave_rows8 lays them ([N / 8, groups, 8]).
struct Interleaved {
  const uint8_t* codes;
  const void* scales;
  const void* biases;
  int N, K, bits, group, dtype;
  bool signed_codes;

  // Row `row`'s K values into out: an id outside [0, N) gives a row of NaN, never a read outside
  // the layer.
  void row(int64_t row, float* out) const {
    if (row < 0 || row >= N) {
      std::fill(out, out + K, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    const int64_t eight = row / 8, i = row % 8;
    const int lanes = bits == 4 ? 4 : 8;  // a block's 32 codes: 16 bytes a row at 4 bits, 32 at 8
    const int blocks = K / 32, groups = K / group;
    for (int b = 0; b < blocks; b++) {
      // The row's bytes of block b: lane j's four at [eight, b, j, i, 0..3].
      const uint8_t* block = codes + ((eight * blocks + b) * lanes * 8 + i) * 4;
      for (int p = 0; p < 32; p++) {
        int code;
        if (bits == 4) {  // p = 8 j + 4 h + t: byte t of lane j, its low (h 0) or high nibble
          const uint8_t byte = block[(p / 8) * 32 + p % 4];
          code = (p % 8) < 4 ? byte & 15 : byte >> 4;
        } else {  // p = 4 j + t
          const uint8_t byte = block[(p / 4) * 32 + p % 4];
          code = signed_codes ? static_cast<uint8_t>(byte ^ 0x80) : byte;
        }
        const int k = 32 * b + p, g = k / group;
        const size_t at = (static_cast<size_t>(eight) * groups + g) * 8 + i;
        const float scaled = param(scales, at, dtype) * static_cast<float>(code);
        out[k] = scaled + param(biases, at, dtype);
      }
    }
  }
};

class InterleavedLookup : public CpuPrimitive {
 public:
  InterleavedLookup(mx::Stream stream, int bits, int group)
      : CpuPrimitive(stream), bits_(bits), group_(group) {}

  // inputs: ids (int32, uint32 or int64, any shape), then the layer's codes, scales and biases.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &ids = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    const int dtype = scales.dtype() == mx::float32 ? 0 : scales.dtype() == mx::float16 ? 1 : 2;
    const Interleaved layer{w.data<uint8_t>(),
                            scales.data<void>(),
                            biases.data<void>(),
                            w.shape(0),
                            static_cast<int>(w.shape(1) * 8 / bits_),
                            bits_,
                            group_,
                            dtype,
                            w.dtype() == mx::int8};
    const int M = static_cast<int>(ids.size());
    queue_task(stream(), [layer, M, ids = Ids(ids), op = out.data<float>()]() {
      parallel_rows(
          M, 64,
          [&](int m0, int m1) {
        for (int m = m0; m < m1; m++) layer.row(ids[m], op + static_cast<size_t>(m) * layer.K);
          },
          1);
    });
  }
  const char* name() const override { return "InterleavedLookup"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const InterleavedLookup&>(other);
    return bits_ == o.bits_ && group_ == o.group_;
  }

 private:
  int bits_;
  int group_;
};

}  // namespace

mx::array interleaved_lookup(const mx::array& ids, const mx::array& w, const mx::array& scales,
                             const mx::array& biases, int group_size, int bits) {
  const auto dtype = scales.dtype();
  const bool codes_ok = bits == 4 ? w.dtype() == mx::uint8
                                  : bits == 8 && (w.dtype() == mx::uint8 || w.dtype() == mx::int8);
  const int64_t K = codes_ok && w.ndim() == 2 ? static_cast<int64_t>(w.shape(1)) * 8 / bits : 0;
  if (!codes_ok || w.ndim() != 2 || w.shape(0) % 8 != 0 || K == 0 || K % 32 != 0 ||
      group_size <= 0 || K % group_size != 0 ||
      (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) ||
      biases.dtype() != dtype ||
      scales.shape() != mx::Shape{w.shape(0), static_cast<int>(K / group_size)} ||
      biases.shape() != scales.shape())
    throw std::invalid_argument(
        "interleaved_lookup: expected codes [N, K * bits / 8] interleaved by eight (uint8 at 4 "
        "bits, uint8 or int8 at 8; N a multiple of 8, K of 32 and of the group), and scales and "
        "biases [N, K / group] of one float dtype");
  if (ids.dtype() != mx::int32 && ids.dtype() != mx::uint32 && ids.dtype() != mx::int64)
    throw std::invalid_argument("interleaved_lookup: expected int32, uint32 or int64 ids");
  for (const auto* a : {&w, &scales, &biases})
    if (!a->flags().row_contiguous)
      throw std::invalid_argument("interleaved_lookup: the layer's arrays must be row-contiguous");
  mx::Shape shape = ids.shape();
  shape.push_back(static_cast<int>(K));
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<InterleavedLookup>(s, bits, group_size),
                   {ids, w, scales, biases});
}

}  // namespace hotlora
