// What every x86-64 ISA's code shares: the codes of a chunk of packed weights as bytes, by SSE2
// (every x86-64 CPU's), inlined into each ISA's own code.
#pragma once

#include "kernels/isa/target.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

namespace hotlora::x86 {

// The 32 codes of a chunk of one weight row (16 bytes at 4 bits, 32 at 8) as 32 bytes, in value
// order, 16 a half.
template <int Bits>
inline void code_bytes32(const uint8_t* bytes, __m128i (&halves)[2]) {
  static_assert(Bits == 4 || Bits == 8, "a code width of kernels/quant_types.h unpacked here");
  if constexpr (Bits == 4) {  // value 2i in byte i's low half, 2i+1 in its high half
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const __m128i lo = _mm_and_si128(packed, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
    halves[0] = _mm_unpacklo_epi8(lo, hi);
    halves[1] = _mm_unpackhi_epi8(lo, hi);
  } else {  // a value a byte
    halves[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    halves[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16));
  }
}

}  // namespace hotlora::x86
#endif  // __x86_64__
