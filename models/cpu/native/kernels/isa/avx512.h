// AVX-512's traits: the vector type and operations every kernel is written in, and its register
// blocking. Its code asks for its own target (HOTLORA_AVX512_TARGET) and runs only where the CPU
// has it (kernels/table.cpp checks).
#pragma once

#include "kernels/isa/x86.h"
#include "kernels/types.h"

#if defined(__x86_64__)
// AVX-512's target, for its traits here and its kernels (avx512.cpp), to HOTLORA_TARGET_END.
#define HOTLORA_AVX512_TARGET \
  HOTLORA_TARGET_BEGIN("avx512f,f16c,fma") HOTLORA_QUIET_AVX512_INTRINSICS

HOTLORA_AVX512_TARGET
namespace hotlora::avx512 {

struct Isa {  // 32 vector registers: up to 24 accumulators, the weight rows and one x row
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;  // vector registers
  static constexpr int kShortK = 768, kShortP = 8, kShortR = 2, kLongP = 4, kLongR = 4;
  static constexpr int kFusedR = 4;  // weight rows dequantized in registers at once
  // A prompt's rows against a dequantized tile: 24 accumulators, ten loads for 24 products.
  static constexpr int kTileP = 6, kTileR = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_first(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static V load_half(const uint16_t* p) {  // 16 float16 values, converted exactly
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static float half_to_float(uint16_t half) { return _cvtsh_ss(half); }  // exact
  static void prefetch(const float* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }  // a dropped where NaN; b never NaN
  static V from_bytes(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
  // The 32 codes of a chunk of packed weights as floats, in value order.
  template <int Bits>
  static void codes32(const uint8_t* bytes, V (&out)[2]) {
    __m128i halves[2];
    x86::code_bytes32<Bits>(bytes, halves);
    for (int h = 0; h < 2; h++) out[h] = from_bytes(halves[h]);
  }
  static constexpr bool kTable4 = false;  // codes converted; avx512vbmi picks them instead
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // out[i] = sum(v[i]) for i < 16, the same bits: sum's tree of additions (lanes 8 apart,
  // then 4, 2, 1) taken for sixteen vectors at once, each step's additions in whole vectors.
  // Lane 4u + e of the result holds the source 4e + u, so the sources go in in that order.
  static void sums16(const V (&v)[16], float* out) {
    V a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) {  // units 0, 1 of a[j]: source 2j's lanes i + (i + 8)
      const V x = v[order(2 * j)], y = v[order(2 * j + 1)];
      a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee));
    }
    for (int j = 0; j < 4; j++)  // unit u of b[j]: source 4j + u's lanes i + (i + 4)
      b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                           _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xdd));
    for (int j = 0; j < 2; j++) {  // lanes i + (i + 2), two sources a unit
      const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
      c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                        _mm512_shuffle_ps(c[0], c[1], 0xdd)));
  }
  static constexpr int order(int lane) { return 4 * (lane % 4) + lane / 4; }
};

#include "kernels/isa/x86_int8.h"

}  // namespace hotlora::avx512
HOTLORA_TARGET_END
#endif  // __x86_64__
