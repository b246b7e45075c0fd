// NEON's traits: the vector type and operations every kernel is written in, and its register
// blocking. Every ARMv8-A CPU has NEON and the half-to-float conversion: no target to ask for,
// nothing to check at run time.
#pragma once

#include "kernels/types.h"

#if defined(__aarch64__)
#include <arm_neon.h>

namespace hotlora::neon {

struct Isa {  // 32 vector registers, as AVX-512 has: its register blocks, of 4 lanes
  using V = float32x4_t;
  static constexpr int kLanes = 4;
  static constexpr int kShortK = 768, kShortP = 8, kShortR = 2, kLongP = 4, kLongR = 4;
  static constexpr int kFusedR = 2;  // a chunk of 32 values is 8 vectors a weight row here
  static constexpr int kTileP = 6, kTileR = 4;  // a prompt's rows against a dequantized tile
  static V zero() { return vdupq_n_f32(0.0f); }
  static V load(const float* p) { return vld1q_f32(p); }
  static V load_first(const float* p, int n) {  // no masked load: the n floats, then zeros
    float lanes[kLanes] = {};
    std::memcpy(lanes, p, sizeof(float) * n);
    return vld1q_f32(lanes);
  }
  static V load_half(const uint16_t* p) {  // 4 float16 values, converted exactly
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  static float half_to_float(uint16_t half) {  // exact
    __fp16 value;
    std::memcpy(&value, &half, sizeof value);
    return value;
  }
  static void prefetch(const float* p) { __builtin_prefetch(p); }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static V set1(float a) { return vdupq_n_f32(a); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  // The 32 codes of a chunk of packed weights as floats, in value order.
  template <int Bits>
  static void codes32(const uint8_t* bytes, V (&out)[8]) {
    static_assert(Bits == 4 || Bits == 8, "a code width of kernels/quant_types.h unpacked here");
    uint8x16_t halves[2];
    if constexpr (Bits == 4) {  // value 2i in byte i's low half, 2i+1 in its high half
      const uint8x16_t packed = vld1q_u8(bytes);
      const uint8x16_t lo = vandq_u8(packed, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(packed, 4);
      halves[0] = vzip1q_u8(lo, hi);
      halves[1] = vzip2q_u8(lo, hi);
    } else {  // a value a byte
      halves[0] = vld1q_u8(bytes);
      halves[1] = vld1q_u8(bytes + 16);
    }
    for (int h = 0; h < 2; h++) {  // 16 bytes, widened to 16 bits, then to 32, 4 at a time
      const uint16x8_t wide[2] = {vmovl_u8(vget_low_u8(halves[h])), vmovl_high_u8(halves[h])};
      for (int j = 0; j < 2; j++) {
        const uint32x4_t words[2] = {vmovl_u16(vget_low_u16(wide[j])), vmovl_high_u16(wide[j])};
        for (int i = 0; i < 2; i++) out[h * 4 + j * 2 + i] = vcvtq_f32_u32(words[i]);
      }
    }
  }
  static constexpr bool kTable4 = false;  // codes converted
  static void store(float* p, V v) { vst1q_f32(p, v); }
  // (lane 0 + lane 1) + (lane 2 + lane 3), by pairwise additions as sums16 takes them.
  static float sum(V v) {
    const V pairs = vpaddq_f32(v, v);
    return vgetq_lane_f32(pairs, 0) + vgetq_lane_f32(pairs, 1);
  }
  // out[i] = sum(v[i]) for i < 16, the same bits: four vectors' pairs, then their pairs' sums.
  static void sums16(const V (&v)[16], float* out) {
    for (int i = 0; i < 16; i += 4)
      vst1q_f32(out + i, vpaddq_f32(vpaddq_f32(v[i], v[i + 1]), vpaddq_f32(v[i + 2], v[i + 3])));
  }
};

}  // namespace hotlora::neon
#endif  // __aarch64__
