// A packed embedding's lookup as one primitive (PackedLookup), in either layout of its codes.
//
// MLX composes an embedding's lookup on the CPU from many small operations: the float32 path's
// (the rows of MLX's packing gathered, then `mx.dequantize`, which the CPU runs as shifts, masks,
// broadcasts, a product and a sum) was 38 of the 73 nodes of a one-row decode step's graph on the
// embedded model; the fast path's, whose codes are laid out for the interleaved integer kernel
// (`weights.interleave_rows8`: its use as the output layer takes that kernel without a second
// copy of its weights), picked each id's bytes out of its eight rows' and packed them back as
// MLX packs them first: 61 of 96. As one primitive, a one-row step took 4.8-5.2 ms where it
// took 5.1-6.0 on the fast path, 7.6-8.8 where it took 7.8-9.2 on the float32 path (AVX2 and VNNI,
// alternated in one process, the same logits). The
// arithmetic is mx.dequantize's: each value scale * code + bias in float32, a product then a sum
// (built without FMA, as MLX is), the scales and biases converted to float32 exactly first, so
// the rows are mx.dequantize's to the bit.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "primitives/common.h"
#include "primitives/ops.h"
#include "primitives/products.h"
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

// What a lookup reads: the layer's N rows of codes and their scales and biases as the products
// read them (`packed_weight`: 4 or 8 bits; MLX's packing, uint32 words, code k of a row in bits
// k * bits of its words, the scales row-major; or `rows8`, interleave_rows8's bytes: uint8 at 4,
// 5 and 6 bits, a code's low four bits as at 4 and the others in bit planes, int8 at 8, whose
// codes are the bytes' values + 128; the scales [N / 8, groups, 8]).
struct PackedRows {
  Quantized q;
  int N;

  // Row `row`'s K values into out: an id outside [0, N) gives a row of NaN, never a read outside
  // the layer.
  void row(int64_t row, float* out) const {
    const int K = q.K;
    if (row < 0 || row >= N) {
      std::fill(out, out + K, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    const int groups = K / q.group;
    for (int k = 0; k < K; k++) {
      const size_t at = q.rows8
                            ? (static_cast<size_t>(row / 8) * groups + k / q.group) * 8 + row % 8
                            : static_cast<size_t>(row) * groups + k / q.group;
      const float scaled = param(q.scales, at, q.dtype) * static_cast<float>(code(row, k));
      out[k] = scaled + param(q.biases, at, q.dtype);
    }
  }

  int code(int64_t row, int k) const {
    const int K = q.K, bits = q.bits;
    const auto* codes = reinterpret_cast<const uint8_t*>(q.w);
    if (!q.rows8) {  // the row's bytes hold its codes in order, two a byte at 4 bits, low first
      const uint8_t byte = codes[static_cast<size_t>(row) * K * bits / 8 + k * bits / 8];
      return bits == 4 ? (k % 2 ? byte >> 4 : byte & 15) : byte;
    }
    // Block k / 32 of the row's eight: lane j's four bytes at [row / 8, block, j, row % 8, 0..3],
    // then at 5 and 6 bits each plane's at [.., 4 + plane, row % 8, 0..3].
    const int p = k % 32;
    const uint8_t* block = codes + (static_cast<size_t>(row / 8) * (K / 32) + k / 32) * 32 * bits +
                           static_cast<size_t>(row % 8) * 4;
    if (bits < 8) {  // p = 8 j + 4 h + t: byte t of lane j, its low (h 0) or high nibble
      const uint8_t byte = block[(p / 8) * 32 + p % 4];
      int value = (p % 8) < 4 ? byte & 15 : byte >> 4;
      for (int plane = 0; plane < rows8_planes(bits); plane++)  // p = 4 m + t: bit m of byte t
        value |= ((block[128 + 32 * plane + p % 4] >> (p / 4)) & 1) << (4 + plane);
      return value;
    }
    const uint8_t byte = block[(p / 4) * 32 + p % 4];  // p = 4 j + t
    return static_cast<uint8_t>(byte ^ 0x80);          // stored as q - 128
  }
};

class PackedLookup : public CpuPrimitive {
 public:
  PackedLookup(mx::Stream stream, int bits, int group)
      : CpuPrimitive(stream), bits_(bits), group_(group) {}

  // inputs: ids (int32, uint32 or int64, any shape), then the layer's codes, scales and biases.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &ids = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
    const int K = static_cast<int>(w.shape(1) * (w.itemsize() * 8) / bits_);
    const PackedRows layer{packed_weight(w, scales, biases, K, bits_, group_, "packed_lookup"),
                           w.shape(0)};
    const int M = static_cast<int>(ids.size());
    dispatch_rows(stream(), inputs, 0, outputs[0], [layer, M, ids = Ids(ids)](auto&, float* op) {
      parallel_rows(
          M, 64,
          [&](int m0, int m1) {
        for (int m = m0; m < m1; m++) layer.row(ids[m], op + static_cast<size_t>(m) * layer.q.K);
          },
          1);
    });
  }
  const char* name() const override { return "PackedLookup"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PackedLookup&>(other);
    return bits_ == o.bits_ && group_ == o.group_;
  }

 private:
  int bits_;
  int group_;
};

}  // namespace

mx::array packed_lookup(const mx::array& ids, const mx::array& w, const mx::array& scales,
                        const mx::array& biases, int group_size, int bits) {
  const auto dtype = scales.dtype();
  const bool rows8 = w.dtype() == mx::uint8 || w.dtype() == mx::int8;
  const bool planes = bits == 5 || bits == 6;  // interleaved only
  const bool codes_ok = (bits == 4 || bits == 8 || (planes && rows8)) && w.ndim() == 2 &&
                        (w.dtype() == mx::uint32 ||
                         (rows8 && w.shape(0) % 8 == 0 && (bits == 8) == (w.dtype() == mx::int8)));
  const int64_t K = codes_ok ? static_cast<int64_t>(w.shape(1)) * w.itemsize() * 8 / bits : 0;
  if (!codes_ok || K == 0 || (rows8 && K % 32 != 0) || group_size <= 0 || K % group_size != 0 ||
      (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) ||
      biases.dtype() != dtype ||
      scales.shape() != mx::Shape{w.shape(0), static_cast<int>(K / group_size)} ||
      biases.shape() != scales.shape())
    throw std::invalid_argument(
        "packed_lookup: expected codes at 4 or 8 bits, [N, K * bits / 32] uint32 (MLX's packing) "
        "or [N, K * bits / 8] interleaved by eight (uint8 at 4, 5 or 6 bits, int8 at 8; N a "
        "multiple of 8, K of 32), K a multiple of the group, and scales and biases [N, K / group] "
        "of one float dtype");
  if (ids.dtype() != mx::int32 && ids.dtype() != mx::uint32 && ids.dtype() != mx::int64)
    throw std::invalid_argument("packed_lookup: expected int32, uint32 or int64 ids");
  mx::Shape shape = ids.shape();
  shape.push_back(static_cast<int>(K));
  const auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<PackedLookup>(s, bits, group_size),
                   {ids, w, scales, biases});
}

}  // namespace hotlora
