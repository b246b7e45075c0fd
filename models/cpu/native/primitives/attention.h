// Each query token's attention over its own keys, as RowsAttention (primitives/attention.cpp)
// queues it and DecoderLayers (primitives/decoder_layer.cpp) runs it on each layer's KV cache.
#pragma once

#include <cstdint>

#include "kernels/types.h"
#include "mlx/array.h"
#include "primitives/common.h"

namespace hotlora {

// A KV cache's keys or values [B, heads, S, D] for the attention: read in place when each
// position's D floats are contiguous (a slice of the cache), else from a packed copy.
class CacheView {
 public:
  explicit CacheView(const mx::array& a)
      : source_(a), data_(a.data<float>()), strides_(a.strides()), in_place_(a.strides(3) == 1) {
    if (!in_place_) {
      strides_[3] = 1, strides_[2] = a.shape(3);
      strides_[1] = strides_[2] * a.shape(2), strides_[0] = strides_[1] * a.shape(1);
    }
  }
  // In the task, once the data is there.
  void prepare() {
    if (!in_place_) data_ = source_.get();
  }
  const float* at(int b, int h) const { return data_ + b * strides_[0] + h * strides_[1]; }
  int64_t step() const { return strides_[2]; }

 private:
  RowMajor source_;
  const float* data_;
  mx::Strides strides_;
  bool in_place_;
};

// Where a bool mask [B, 1, L, S] says which keys each query token sees (a broadcast view reads in
// place): its data and its strides over rows, tokens and keys.
struct KeyMask {
  const bool* visible;
  int64_t row, token, step;

  explicit KeyMask(const mx::array& mask)
      : visible(mask.data<bool>()),
        row(mask.strides(0)),
        token(mask.strides(2)),
        step(mask.strides(3)) {}
};

// softmax(q * scale . k^T over the keys the mask shows) . v for each query token of q
// [B, H, L, D] over the first S positions of `keys` [B, Hkv, *, D] and `values` [B, Hkv, *, Dv]
// (prepared), into op: [B, H, L, Dv], or [B, L, H * Dv] when `merged`. Query head h reads KV
// head h / (H / Hkv), as MLX groups them. On the pool's threads, a block of query tokens'
// KV head a unit (as many as a MiB of scores holds: each block of keys and values read serves
// them all).
void attend_rows(Attend attend, const float* q, int B, int H, int L, int D, const CacheView& keys,
                 const CacheView& values, int Hkv, int S, int Dv, const KeyMask& mask, float scale,
                 bool merged, float* op);

}  // namespace hotlora
