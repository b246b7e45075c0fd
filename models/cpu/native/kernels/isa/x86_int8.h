// The integer products' traits of an x86-64 ISA with AVX2 (kernels/int8_matmul.h): 256-bit
// vectors, each block of 32 codes one vector of bytes, its products with the activations' int8
// codes summed in pairs (vpmaddubsw), then in fours into 32-bit lanes (vpmaddwd). Included
// inside an ISA's namespace, under its target, which AVX2's instructions are part of; each
// inclusion is another ISA, so no include guard.

struct Int8 {  // 16 vector registers: 8 accumulators, the codes of two weight rows, x's block
  using V = __m256;
  using Codes = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int kP = 4, kR = 2;  // rows of x by weight rows: a batch's
  static constexpr int kR1 = 4;         // weight rows at once for a row alone
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_first(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static V load_half(const uint16_t* p) {  // 8 float16 values, converted exactly
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // A block's 32 codes as bytes, in the activations' order: at 4 bits the low halves of its 16
  // bytes (values 0, 2, ..., 30), then the high ones (1, 3, ..., 31); at 8 bits q - 128.
  template <int Bits>
  static Codes codes(const uint8_t* bytes) {
    static_assert(Bits == 4 || Bits == 8, "a code width of kernels/quant_types.h unpacked here");
    if constexpr (Bits == 4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
      return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                              _mm256_set1_epi8(0x0f));
    } else {
      return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)),
                              _mm256_set1_epi8(static_cast<char>(0x80)));
    }
  }
  // A block's 32 int8 activations (kernels/quantize_rows.h's order).
  static Codes activations(const int8_t* xq) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  }
  // sum(codes * x) over the block, in 8 lanes, as floats (exact: at most 32 * 128 * 127).
  // vpmaddubsw multiplies unsigned bytes by signed ones: 4-bit codes are both; a signed 8-bit
  // code goes in as its magnitude, its sign moved onto x's byte (no pair of products past
  // 2 * 128 * 127, so none saturates).
  template <int Bits>
  static V dot(Codes codes, Codes x) {
    __m256i pairs;
    if constexpr (Bits == 4)
      pairs = _mm256_maddubs_epi16(codes, x);
    else
      pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(x, codes));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }

  // The products of 4-bit weights whose rows are interleaved by eight (kernels/int8_matmul.h's
  // int8_rows8_range): a 32-bit lane a weight row, its four bytes four codes.
  static constexpr bool kRows8 = true;
  static constexpr int kRows8P = 4;  // rows of x at once
  static Codes load_bytes(const uint8_t* p, size_t /*stride: one group of eight a vector*/) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static Codes low4(Codes v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
  static Codes high4(Codes v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
  }
  // Bit M of each byte of h as its bit To, the others 0: a code's bit To from its bit plane
  // (kernels/int8_matmul.h's Rows8Codes). The lane shifts by To - M, so bit M of byte k lands
  // on bit To of byte k and no other bit does.
  template <int M, int To>
  static Codes bit_as(Codes h) {
    if constexpr (M < To)
      h = _mm256_slli_epi32(h, To - M);
    else if constexpr (M > To)
      h = _mm256_srli_epi32(h, M - To);
    return _mm256_and_si256(h, _mm256_set1_epi8(static_cast<char>(1 << To)));
  }
  static Codes or_bits(Codes a, Codes b) { return _mm256_or_si256(a, b); }
  // Four int8 activations in every lane.
  static Codes broadcast4(const int8_t* p) {
    int32_t four;
    std::memcpy(&four, p, sizeof four);
    return _mm256_set1_epi32(four);
  }
  // Each lane's four codes times its four activations, summed in two 16-bit halves: at most
  // 2 * 15 * 127 each for 4-bit codes (eight such sums fit 16 bits), 2 * 63 * 127 for 5- and
  // 6-bit ones (two fit), 2 * 128 * 127 for signed ones (one).
  static Codes pairs4(Codes codes, Codes x) { return _mm256_maddubs_epi16(codes, x); }
  static Codes add16(Codes a, Codes b) { return _mm256_add_epi16(a, b); }
  static Codes zero16() { return _mm256_setzero_si256(); }
  // Each lane's two 16-bit halves added into one 32-bit sum.
  static Codes widen(Codes halves) { return _mm256_madd_epi16(halves, _mm256_set1_epi16(1)); }
  static Codes add32(Codes a, Codes b) { return _mm256_add_epi32(a, b); }
  static Codes sub32(Codes a, Codes b) { return _mm256_sub_epi32(a, b); }
  static Codes set32(int32_t a) { return _mm256_set1_epi32(a); }
  // Each signed byte c as the unsigned byte c + 128.
  static Codes flip_signs(Codes c) {
    return _mm256_xor_si256(c, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  static Codes zero32() { return _mm256_setzero_si256(); }
  static V to_float(Codes sums) { return _mm256_cvtepi32_ps(sums); }  // exact: |sums| < 2^24
  // Signed codes' products with x: a code's magnitude times x with the code's sign (vpsignb),
  // so that vpmaddubsw's unsigned operand is the magnitude.
  static Codes magnitudes(Codes codes) { return _mm256_sign_epi8(codes, codes); }
  static Codes signs_of(Codes x, Codes codes) { return _mm256_sign_epi8(x, codes); }
  // Eight scales or biases of `dtype` (Quantized::dtype), exactly as float32.
  template <int Dtype>
  static V load8(const void* p, size_t at, size_t /*stride: one group of eight a vector*/ = 0) {
    if constexpr (Dtype == 0) return _mm256_loadu_ps(static_cast<const float*>(p) + at);
    const auto* halves = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at);
    if constexpr (Dtype == 1) return _mm256_cvtph_ps(_mm_loadu_si128(halves));
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(halves)), 16));
  }
};
