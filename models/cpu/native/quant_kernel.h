// The quantized kernel of rows_matmul.cpp, written once for every vector ISA: included after
// rows_kernel.h inside a namespace that defines `Isa`, under that ISA's target.
// No include guard: each inclusion is another ISA.
//
// MLX's affine quantization: weight row n holds K values of `bits` bits packed into uint32
// words, the lowest bits first; each group of `group` values has a scale and a bias, and value
// q dequantizes to scale * q + bias. A tile of weight rows is dequantized into a float buffer
// that stays in cache, then every row of x is multiplied by it with the float kernel's blocks:
// each output is the same fixed-order sum over K whatever the number of rows.

// 16 consecutive values, one a byte, as floats: scale * value + bias, rounded as MLX's
// dequantize rounds it in float32 (a product, then a sum).
inline void put16(__m128i bytes, typename Isa::V scale, typename Isa::V bias, float* out) {
  for (int i = 0; i < 16; i += Isa::kLanes) {
    const __m128i part = i == 0 ? bytes : _mm_srli_si128(bytes, 8);
    Isa::store(out + i, Isa::add(Isa::mul(Isa::from_bytes(part), scale), bias));
  }
}

// Rows [n0, n0 + T) of the weights as floats: out [T, K].
inline void dequantize_rows(const Quantized& q, int n0, int T, float* out) {
  const int K = q.K, groups = K / q.group;
  const size_t row_bytes = static_cast<size_t>(K) * q.bits / 8;
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int t = 0; t < T; t++) {
    const size_t n = static_cast<size_t>(n0 + t);
    const auto* bytes = reinterpret_cast<const uint8_t*>(q.w) + n * row_bytes;
    float* row = out + static_cast<size_t>(t) * K;
    for (int g = 0; g < groups; g++) {
      const size_t at = n * groups + g;
      const typename Isa::V scale = Isa::set1(quant_param(q.scales, at, q.dtype));
      const typename Isa::V bias = Isa::set1(quant_param(q.biases, at, q.dtype));
      for (int k = g * q.group; k < (g + 1) * q.group; k += 32) {
        if (q.bits == 4) {  // 32 values in 16 bytes: value 2i in byte i's low half, 2i+1 high
          const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + k / 2));
          const __m128i lo = _mm_and_si128(packed, low);
          const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
          put16(_mm_unpacklo_epi8(lo, hi), scale, bias, row + k);
          put16(_mm_unpackhi_epi8(lo, hi), scale, bias, row + k + 16);
        } else {  // 8 bits: a value a byte
          const auto* p = reinterpret_cast<const __m128i*>(bytes + k);
          put16(_mm_loadu_si128(p), scale, bias, row + k);
          put16(_mm_loadu_si128(p + 1), scale, bias, row + k + 16);
        }
      }
    }
  }
}

// Rows [0, M) of x against the T dequantized rows of a tile, into out [M, ldo]: blocks of P
// rows of x outermost, so each stays in L1 while the whole tile passes it.
template <int P, int R>
void tile_rows(const float* x, const float* tile, int K, int T, float* out, int M, int ldo) {
  const Seg none;
  for (int m = 0; m < M; m += P) {
    const int rows = std::min(P, M - m);
    const float* xm = x + static_cast<size_t>(m) * K;
    float* om = out + static_cast<size_t>(m) * ldo;
    int t = 0;
    for (; t + R <= T; t += R) {
      const Seg seg{xm, tile + static_cast<size_t>(t) * K, K};
      if (rows == P)
        block<P, R, false>(seg, none, om + t, ldo);
      else
        last_rows<P, R>(rows, seg, none, om + t, ldo);
    }
    for (; t < T; t++) {
      const Seg seg{xm, tile + static_cast<size_t>(t) * K, K};
      if (rows == P)
        block<P, 1, false>(seg, none, om + t, ldo);
      else
        last_rows<P, 1>(rows, seg, none, om + t, ldo);
    }
  }
}

// out[:, n0:n1] of x @ dequantize(q).T; out is [M, N]. `tile` holds `tile_floats` floats.
void quant_matmul_range(const Quantized& q, const float* x, float* out, int M, int N, int n0,
                        int n1, float* tile, int tile_floats) {
  const int K = q.K;
  const bool short_k = K <= Isa::kShortK;
  const int R = short_k ? Isa::kShortR : Isa::kLongR;
  const int T = std::max(R, tile_floats / K / R * R);
  for (int n = n0; n < n1; n += T) {
    const int rows = std::min(T, n1 - n);
    dequantize_rows(q, n, rows, tile);
    if (short_k)
      tile_rows<Isa::kShortP, Isa::kShortR>(x, tile, K, rows, out + n, M, N);
    else
      tile_rows<Isa::kLongP, Isa::kLongR>(x, tile, K, rows, out + n, M, N);
  }
}

// out[n0:n1] of one row of x += its low-rank residual, b [R, N]: for the columns r its mask
// keeps, in order, h[r] * b[r, n] added one at a time (a fused multiply-add each). Each output
// is its own sequence of operations: its bits depend neither on the vector width nor on the
// columns the mask drops (other rows' adapters).
void add_residuals(const float* h, const float* b, int N, const int* columns, int count,
                   float* out, int n0, int n1) {
  int n = n0;
  for (; n + Isa::kLanes <= n1; n += Isa::kLanes) {
    typename Isa::V acc = Isa::load(out + n);
    for (int i = 0; i < count; i++) {
      const int r = columns[i];
      acc = Isa::fma(Isa::set1(h[r]), Isa::load(b + static_cast<size_t>(r) * N + n), acc);
    }
    Isa::store(out + n, acc);
  }
  for (; n < n1; n++) {
    float acc = out[n];
    for (int i = 0; i < count; i++)
      acc = std::fma(h[columns[i]], b[static_cast<size_t>(columns[i]) * N + n], acc);
    out[n] = acc;
  }
}
