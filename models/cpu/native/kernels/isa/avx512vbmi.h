// AVX-512's traits with VBMI's byte shifts: 4-bit codes picked from a vector of their sixteen
// dequantized values instead of converted one by one; the same bits for fewer instructions.
#pragma once

#include "kernels/isa/avx512.h"

#if defined(__x86_64__)
// AVX-512 VBMI's target, for its traits here and its kernels (avx512vbmi.cpp), to
// HOTLORA_TARGET_END.
#define HOTLORA_AVX512VBMI_TARGET \
  HOTLORA_TARGET_BEGIN("avx512f,avx512vbmi,f16c") HOTLORA_QUIET_AVX512_INTRINSICS

HOTLORA_AVX512VBMI_TARGET
namespace hotlora::avx512vbmi {

struct Isa : avx512::Isa {  // AVX-512's, with 4-bit codes picked by VBMI's byte shifts
  // 4-bit values as picks from a vector of the sixteen (kernels/quant_matmul.h's dequantize32).
  static constexpr bool kTable4 = true;
  static V codes16() {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  // out[h][j] = table[value 16h + j] for the 32 values of 16 bytes (value 2i in byte i's low
  // half, 2i+1 in its high half): lane j takes bits [4j, 4j + 8) of the 8 bytes of its half
  // (vpmultishiftqb), and the permute reads only a lane's low four bits.
  static void lookup4(const uint8_t* bytes, V table, V (&out)[2]) {
    const __m512i at = _mm512_setr_epi64(0x0000000400000000, 0x0000000c00000008, 0x0000001400000010,
                                         0x0000001c00000018, 0x0000002400000020, 0x0000002c00000028,
                                         0x0000003400000030, 0x0000003c00000038);
    for (int h = 0; h < 2; h++) {
      uint64_t eight;
      std::memcpy(&eight, bytes + 8 * h, sizeof eight);
      const __m512i codes = _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64(eight));
      out[h] = _mm512_permutexvar_ps(codes, table);
    }
  }
};

}  // namespace hotlora::avx512vbmi
HOTLORA_TARGET_END
#endif  // __x86_64__
