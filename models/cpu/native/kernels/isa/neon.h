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
  static constexpr int kRegisters = 32;  // vector registers
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
  static V max(V a, V b) { return vmaxnmq_f32(a, b); }  // a dropped where NaN; b never NaN
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

// The integer products' traits (kernels/int8_matmul.h): a block of 32 codes in two vectors of
// bytes, their products with the activations' int8 codes widened to 16 bits (vmull_s8, two
// products a lane at most 2 * 128 * 127) and summed pairwise into 32-bit lanes.
struct Int8 {
  using V = float32x4_t;
  struct Codes {
    int8x16_t low, high;  // values 0-15 and 16-31 of the block, in the activations' order
  };
  static constexpr int kLanes = 4;
  static constexpr int kP = 4, kR = 4;  // rows of x by weight rows: a batch's
  static constexpr int kR1 = 4;         // weight rows at once for a row alone
  static V zero() { return vdupq_n_f32(0.0f); }
  static V set1(float a) { return vdupq_n_f32(a); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static V load(const float* p) { return vld1q_f32(p); }
  static V load_first(const float* p, int n) { return Isa::load_first(p, n); }
  static V load_half(const uint16_t* p) { return Isa::load_half(p); }
  static void store(float* p, V v) { vst1q_f32(p, v); }
  static float sum(V v) { return Isa::sum(v); }
  // At 4 bits the low halves of the block's 16 bytes (values 0, 2, ..., 30), then the high
  // ones; at 8 bits q - 128.
  template <int Bits>
  static Codes codes(const uint8_t* bytes) {
    static_assert(Bits == 4 || Bits == 8, "a code width of kernels/quant_types.h unpacked here");
    if constexpr (Bits == 4) {
      const uint8x16_t packed = vld1q_u8(bytes);
      return {vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0f))),
              vreinterpretq_s8_u8(vshrq_n_u8(packed, 4))};
    } else {
      const uint8x16_t offset = vdupq_n_u8(0x80);
      return {vreinterpretq_s8_u8(veorq_u8(vld1q_u8(bytes), offset)),
              vreinterpretq_s8_u8(veorq_u8(vld1q_u8(bytes + 16), offset))};
    }
  }
  // A block's 32 int8 activations (kernels/quantize_rows.h's order).
  static Codes activations(const int8_t* xq) { return {vld1q_s8(xq), vld1q_s8(xq + 16)}; }
  // sum(codes * x) over the block, in 4 lanes, as floats (exact).
  template <int Bits>
  static V dot(Codes codes, Codes x) {
    const int16x8_t p0 =
        vmlal_high_s8(vmull_s8(vget_low_s8(codes.low), vget_low_s8(x.low)), codes.low, x.low);
    const int16x8_t p1 =
        vmlal_high_s8(vmull_s8(vget_low_s8(codes.high), vget_low_s8(x.high)), codes.high, x.high);
    return vcvtq_f32_s32(vpadalq_s16(vpaddlq_s16(p0), p1));
  }
};

}  // namespace hotlora::neon
#endif  // __aarch64__
