// AVX2's traits (with FMA and F16C): the vector type and operations every kernel is written in,
// and its register blocking. Its code asks for its own target (HOTLORA_AVX2_TARGET) and runs only
// where the CPU has it (kernels/table.cpp checks).
#pragma once

#include "kernels/isa/x86.h"
#include "kernels/types.h"

#if defined(__x86_64__)
// AVX2's target, for its traits here and its kernels (avx2.cpp), to HOTLORA_TARGET_END.
#define HOTLORA_AVX2_TARGET HOTLORA_TARGET_BEGIN("avx2,fma,f16c")

HOTLORA_AVX2_TARGET
namespace hotlora::avx2 {

struct Isa {  // 16 vector registers: 8 accumulators, 12 against a tile
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;  // vector registers
  static constexpr int kShortK = 4096, kShortP = 4, kShortR = 2, kLongP = 2, kLongR = 4;
  static constexpr int kFusedR = 2;
  // A prompt's rows against a dequantized tile: 4 rows of x by 3 weight rows, 12 accumulators,
  // 3 weight vectors and one of x. Against 4 by 2, each value of x read from cache serves a third
  // more products: 16, 64 and 192 rows of x took 0.65-0.74 the time on the embedded model's and
  // the ~0.8B one's shapes (0.93 at 192 rows by K = 5,632, where neither x's rows nor the tile
  // stay in L1), the same bits (each output's sum the same).
  static constexpr int kTileP = 4, kTileR = 3;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_first(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static V load_half(const uint16_t* p) {  // 8 float16 values, converted exactly
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float half_to_float(uint16_t half) { return _cvtsh_ss(half); }  // exact
  static void prefetch(const float* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }  // a dropped where NaN; b never NaN
  static V from_bytes(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
  // The 32 codes of a chunk of packed weights as floats, in value order.
  template <int Bits>
  static void codes32(const uint8_t* bytes, V (&out)[4]) {
    __m128i halves[2];
    x86::code_bytes32<Bits>(bytes, halves);
    for (int h = 0; h < 2; h++) {
      out[2 * h] = from_bytes(halves[h]);
      out[2 * h + 1] = from_bytes(_mm_srli_si128(halves[h], 8));
    }
  }
  // One row of x against this many weight rows at once, their codes a vector at a time
  // (kernels/quant_matmul.h's `one_row_block`).
  static constexpr int kOneRowR = 3;
  // Codes [8 * i, 8 * i + 8) of a chunk as floats: at 4 bits, the 32-bit word that holds them
  // in every lane, each lane shifted to its own code (two integer operations, no shuffle).
  template <int Bits>
  static V code_vector(const uint8_t* bytes, int i) {
    static_assert(Bits == 4 || Bits == 8, "a code width of kernels/quant_types.h unpacked here");
    if constexpr (Bits == 4) {
      int32_t word;
      std::memcpy(&word, bytes + 4 * i, sizeof word);
      const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
      const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
      return _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(0x0f)));
    } else {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * i));
      return from_bytes(codes);
    }
  }
  static constexpr bool kTable4 = false;  // a permute picks from eight lanes, not sixteen
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // sum's bits for 16 vectors, each of its additions in whole vectors: 8 at a time, halves, then
  // pairs within a half, then neighbours (sum's tree: (v0 + v4) + (v2 + v6), then (v1 + v5) +
  // (v3 + v7), then the two), sources taken in the order that leaves lane i the sum of v[i].
  static void sums16(const V (&v)[16], float* out) {
    for (int h = 0; h < 16; h += 8) {
      V a[4], b[2];
      for (int j = 0; j < 4; j++) {  // halves of sources 2j, 2j + 1: lanes i + (i + 4)
        const V x = v[h + order(2 * j)], y = v[h + order(2 * j + 1)];
        a[j] =
            _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
      }
      for (int j = 0; j < 2; j++)  // lanes i + (i + 2), two sources a half
        b[j] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * j], a[2 * j + 1], 0x44),
                             _mm256_shuffle_ps(a[2 * j], a[2 * j + 1], 0xee));
      _mm256_storeu_ps(out + h, _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88),
                                              _mm256_shuffle_ps(b[0], b[1], 0xdd)));
    }
  }
  static constexpr int order(int lane) { return 4 * (lane % 2) + lane / 2; }
};

#include "kernels/isa/x86_int8.h"

}  // namespace hotlora::avx2
HOTLORA_TARGET_END
#endif  // __x86_64__
