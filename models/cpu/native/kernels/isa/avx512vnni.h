// AVX-512's traits, with VNNI's integer dot product for the products on int8 activations:
// each 32-bit lane's four unsigned bytes times the four signed bytes of the activations, added
// into the lane in one instruction (vpdpbusd) where AVX2 takes two and a 16-bit step
// (vpmaddubsw, vpmaddwd). Integer sums are exact either way: the same bits as AVX2's.
#pragma once

#include "kernels/isa/avx512.h"

#if defined(__x86_64__)
// AVX-512 VNNI's target, for its traits here and its kernels (avx512vnni.cpp), to
// HOTLORA_TARGET_END.
#define HOTLORA_AVX512VNNI_TARGET                                                \
  HOTLORA_TARGET_BEGIN("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma") \
  HOTLORA_QUIET_AVX512_INTRINSICS

HOTLORA_AVX512VNNI_TARGET
namespace hotlora::avx512vnni {

struct Isa : avx512::Isa {};

struct Int8 : avx512::Int8 {  // AVX2's integer traits, each block's sums in one instruction
  // acc plus, in each 32-bit lane, its four unsigned bytes of `u` times its four signed bytes
  // of `s` (no step saturates: four products of at most 255 * 128).
  static constexpr bool kDotBytes = true;
  static Codes dot_bytes(Codes acc, Codes u, Codes s) { return _mm256_dpbusd_epi32(acc, u, s); }
  template <int Bits>
  static V dot(Codes codes, Codes x) {
    const Codes zero = _mm256_setzero_si256();
    if constexpr (Bits == 4)
      return _mm256_cvtepi32_ps(dot_bytes(zero, codes, x));
    else
      return _mm256_cvtepi32_ps(dot_bytes(zero, magnitudes(codes), signs_of(x, codes)));
  }
};

// The products of weight rows interleaved by eight (kernels/int8_matmul.h's int8_rows8_range) in
// 512-bit vectors: two groups of eight side by side, a weight row a 32-bit lane as in Int8's, so
// each lane's operations, and its bits, are Int8's.
struct Int8Wide {
  using V = __m512;
  using Codes = __m512i;
  static constexpr bool kRows8 = true, kDotBytes = true;
  static constexpr int kGroups = 2;  // groups of eight weight rows a vector
  static constexpr int kRows8P = 4;  // rows of x at once
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V to_float(Codes sums) { return _mm512_cvtepi32_ps(sums); }  // exact: |sums| < 2^24
  // A group's 32 bytes at p, the next group's `stride` bytes on.
  static Codes load_bytes(const uint8_t* p, size_t stride) {
    const auto low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const auto high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + stride));
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  // Eight scales or biases of `dtype` at `at`, and the next group's eight `stride` on.
  template <int Dtype>
  static V load8(const void* p, size_t at, size_t stride) {
    const __m256 low = Int8::load8<Dtype>(p, at), high = Int8::load8<Dtype>(p, at + stride);
    return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
  }
  static Codes low4(Codes v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
  static Codes high4(Codes v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
  }
  template <int M, int To>
  static Codes bit_as(Codes h) {  // Int8's, two groups of eight rows at once
    if constexpr (M < To)
      h = _mm512_slli_epi32(h, To - M);
    else if constexpr (M > To)
      h = _mm512_srli_epi32(h, M - To);
    return _mm512_and_si512(h, _mm512_set1_epi8(static_cast<char>(1 << To)));
  }
  static Codes or_bits(Codes a, Codes b) { return _mm512_or_si512(a, b); }
  static Codes broadcast4(const int8_t* p) {  // four int8 activations in every lane
    int32_t four;
    std::memcpy(&four, p, sizeof four);
    return _mm512_set1_epi32(four);
  }
  static Codes dot_bytes(Codes acc, Codes u, Codes s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static Codes add32(Codes a, Codes b) { return _mm512_add_epi32(a, b); }
  static Codes sub32(Codes a, Codes b) { return _mm512_sub_epi32(a, b); }
  static Codes set32(int32_t a) { return _mm512_set1_epi32(a); }
  // Each signed byte c as the unsigned byte c + 128.
  static Codes flip_signs(Codes c) {
    return _mm512_xor_si512(c, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static Codes zero32() { return _mm512_setzero_si512(); }
};

}  // namespace hotlora::avx512vnni
HOTLORA_TARGET_END
#endif  // __x86_64__
