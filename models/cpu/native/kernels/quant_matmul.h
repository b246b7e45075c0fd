// `x @ dequantize(w).T` for packed quantized weights, written once for every ISA: included
// inside an ISA's namespace, under its target, after its traits (`Isa`, kernels/isa/*.h) and
// kernels/matmul.h; each inclusion is another ISA, so no include guard.
//
// MLX's affine quantization: weight row n holds K values of `bits` bits packed into uint32
// words, the lowest bits first; each group of `group` values has a scale and a bias, and value
// q dequantizes to scale * q + bias (kernels/quant_types.h lists the widths served). A tile of
// weight rows is dequantized into a float buffer that stays in cache, then every row of x is
// multiplied by it in register blocks (BLAS's outer products, many rows of x by a few weight
// rows): each output is the same fixed-order sum over K, the float kernel's, whatever the number
// of rows.

// Element i of a scales or biases array of `dtype` (Quantized::dtype), as a float: a half by
// the ISA's conversion, a bfloat16 by its bits.
inline float quant_param(const void* p, size_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  const uint16_t half = static_cast<const uint16_t*>(p)[i];
  if (dtype == 1) return Isa::half_to_float(half);
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// The 32 values of a chunk of one weight row (32 * Bits / 8 bytes) as floats in registers,
// `32 / kLanes` vectors: scale * value + bias, rounded as MLX's dequantize rounds it in float32
// (a product, then a sum). With float16 scales (`Exact`) the product is exact in float32 (11
// significant bits times 8 at most), so one fused multiply-add, which rounds only the sum, gives
// the same bits in one operation instead of two. At 4 bits, where the ISA can (Isa::kTable4),
// the sixteen possible values of the group are computed once, each rounded so, and the codes
// pick from them: the same bits for fewer instructions a value.
constexpr int kChunkVectors = 32 / Isa::kLanes;

// The groups whose scales and biases a weight row's dequantization converts to floats at once,
// float16 ones a vector at a time, each then broadcast from memory. One at a time, each group of
// each weight row took a scalar conversion and a broadcast between registers, ~5 cycles of a
// group's ~12 in a product of one row (2,048 x 5,632, groups of 32, on the AVX-512 machine: 1.49
// ms so, 1.05 at groups of 128, 0.97 now).
constexpr int kParamGroups = 16;

// n (at most kParamGroups) scales or biases from element `at` of an array of `dtype`, as floats.
inline void quant_params(const void* p, size_t at, int n, int dtype, float* out) {
  int i = 0;
  if (dtype == 1)
    for (; i + Isa::kLanes <= n; i += Isa::kLanes)
      Isa::store(out + i, Isa::load_half(static_cast<const uint16_t*>(p) + at + i));
  for (; i < n; i++) out[i] = quant_param(p, at + i, dtype);
}

inline bool exact_products(const Quantized& q) { return q.dtype == 1; }

// Codes as floats, dequantized: scale * codes + bias, rounded as MLX rounds it (one fused
// multiply-add where the product is exact, `Exact`; else a product, then a sum).
template <bool Exact, class I = Isa>
inline typename I::V dequantized(typename I::V codes, typename I::V scale, typename I::V bias) {
  if constexpr (Exact)
    return I::fma(codes, scale, bias);
  else
    return I::add(I::mul(codes, scale), bias);
}

template <int Bits, bool Exact, class I = Isa>
inline void dequantize32(const uint8_t* bytes, typename I::V scale, typename I::V bias,
                         typename I::V (&out)[kChunkVectors]) {
  if constexpr (Bits == 4 && I::kTable4) {
    I::lookup4(bytes, I::add(I::mul(I::codes16(), scale), bias), out);
  } else {
    typename I::V values[kChunkVectors];
    I::template codes32<Bits>(bytes, values);
    for (int i = 0; i < kChunkVectors; i++) out[i] = dequantized<Exact, I>(values[i], scale, bias);
  }
}

// f(bits, exact) with q's code width (one of kernels/quant_types.h's) and whether its products
// are exact, as compile-time constants (std::integral_constant).
template <typename F>
inline void with_type(const Quantized& q, F f) {
  const bool exact = exact_products(q);
  with_quant_bits(q.bits, [&](auto bits) {
    if (exact)
      f(bits, std::true_type{});
    else
      f(bits, std::false_type{});
  });
}

inline const uint8_t* row_bytes(const Quantized& q, int n) {
  return reinterpret_cast<const uint8_t*>(q.w) + static_cast<size_t>(n) * q.K * q.bits / 8;
}

// Asks for the codes kPrefetchBytes past groups [g0, g0 + count) of weight row n, for a decode
// step's products. The weights stream from memory once a call, R rows side by side, and the
// hardware's prefetch falls behind them (kernels/types.h): a step of the embedded model at
// `--cpu-precision exact`, one row, took 12.2-13.1 ms without and 9.2-9.6 with as AVX2 on the
// AVX-512 machine (4 rows 18.1-19.4 against 16.1-17.0), 11.7-14.1 against 8.0-9.2 with its
// VNNI kernels; the same bits. Asking for the scales and biases ahead too, at each row's every
// kParamGroups groups, gave back the gain; a prompt's tiles (dequantize_rows) gained nothing.
template <int Bits>
inline void prefetch_groups(const Quantized& q, int n, int g0, int count) {
  const int group_bytes = q.group * Bits / 8;
  prefetch_ahead(row_bytes(q, n) + static_cast<size_t>(g0) * group_bytes + kPrefetchBytes,
                 count * group_bytes);
}

// Rows [n0, n0 + T) of the weights as floats: out [T, K].
template <int Bits, bool Exact>
inline void dequantize_rows(const Quantized& q, int n0, int T, float* out) {
  const int K = q.K, groups = K / q.group;
  for (int t = 0; t < T; t++) {
    const uint8_t* bytes = row_bytes(q, n0 + t);
    float* row = out + static_cast<size_t>(t) * K;
    float scales[kParamGroups], biases[kParamGroups];
    for (int g0 = 0; g0 < groups; g0 += kParamGroups) {
      const int count = std::min(kParamGroups, groups - g0);
      const size_t at = static_cast<size_t>(n0 + t) * groups + g0;
      quant_params(q.scales, at, count, q.dtype, scales);
      quant_params(q.biases, at, count, q.dtype, biases);
      for (int g = g0; g < g0 + count; g++) {
        const typename Isa::V scale = Isa::set1(scales[g - g0]), bias = Isa::set1(biases[g - g0]);
        for (int k = g * q.group; k < (g + 1) * q.group; k += 32) {
          typename Isa::V w[kChunkVectors];
          dequantize32<Bits, Exact>(bytes + k * Bits / 8, scale, bias, w);
          for (int i = 0; i < kChunkVectors; i++) Isa::store(row + k + i * Isa::kLanes, w[i]);
        }
      }
    }
  }
}

inline void dequantize_tile(const Quantized& q, int n0, int T, float* out) {
  with_type(q, [&](auto bits, auto exact) {
    dequantize_rows<decltype(bits)::value, decltype(exact)::value>(q, n0, T, out);
  });
}

// f(g, scale, bias) for each group g of weight rows [n, n + R), in order, with those rows'
// scales and biases of group g as vectors (R of each): converted kParamGroups groups at a time,
// the rows' codes asked for ahead as it goes (prefetch_groups).
template <int Bits, int R, typename F>
inline void for_each_group(const Quantized& q, int n, F&& f) {
  const int groups = q.K / q.group;
  float params[R][2][kParamGroups];  // each row's scales, then biases, of kParamGroups groups
  for (int g0 = 0; g0 < groups; g0 += kParamGroups) {
    const int count = std::min(kParamGroups, groups - g0);
    for (int r = 0; r < R; r++) {
      const size_t at = static_cast<size_t>(n + r) * groups + g0;
      prefetch_groups<Bits>(q, n + r, g0, count);
      quant_params(q.scales, at, count, q.dtype, params[r][0]);
      quant_params(q.biases, at, count, q.dtype, params[r][1]);
    }
    for (int g = g0; g < g0 + count; g++) {
      typename Isa::V scale[R], bias[R];
      for (int r = 0; r < R; r++) {
        scale[r] = Isa::set1(params[r][0][g - g0]);
        bias[r] = Isa::set1(params[r][1][g - g0]);
      }
      f(g, scale, bias);
    }
  }
}

// out[m, r] = x[m, :] . dequantize(w[n + r, :]) for m < P, r < R, the weights dequantized in
// registers and multiplied at once: for the few rows of a decode step, where a tile in memory
// would be written and read back for a row or two. Each accumulator takes the products in the
// order `block` takes them from a tile, so the bits are the tile's.
template <int Bits, bool Exact, int P, int R>
inline void fused_block(const Quantized& q, const float* x, int n, float* out, int ldo) {
  const int K = q.K;
  typename Isa::V acc[R][P];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) acc[r][m] = Isa::zero();
  const uint8_t* rows[R];
  for (int r = 0; r < R; r++) rows[r] = row_bytes(q, n + r);
  for_each_group<Bits, R>(q, n, [&](int g, const Isa::V(&scale)[R], const Isa::V(&bias)[R]) {
    for (int k = g * q.group; k < (g + 1) * q.group; k += 32) {
      typename Isa::V w[R][kChunkVectors];
      for (int r = 0; r < R; r++)
        dequantize32<Bits, Exact>(rows[r] + k * Bits / 8, scale[r], bias[r], w[r]);
      for (int i = 0; i < kChunkVectors; i++)
        for (int m = 0; m < P; m++) {
          const float* xm = x + static_cast<size_t>(m) * K;
          const typename Isa::V xv = Isa::load(xm + k + i * Isa::kLanes);
          for (int r = 0; r < R; r++) acc[r][m] = Isa::fma(w[r][i], xv, acc[r][m]);
        }
    }
  });
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) out[static_cast<size_t>(m) * ldo + r] = Isa::sum(acc[r][m]);
}

// out[r] = x . dequantize(w[n + r, :]) for r < R, one row of x: `fused_block<.., 1, R>`'s
// operations, each accumulator's in the same order (the same bits), taken a vector of codes at a
// time with the R weight rows' turns interleaved, so that each row's chain of multiply-adds
// waits on its previous one less. Where the ISA names R (Isa::kOneRowR). As AVX2 on the
// AVX-512 machine, R = 3: a 1,536 x 576 product of one row (groups of 32, float16 scales) took
// 38.6-38.9 us against 44.3-45.2 for `fused_block` (35.4 against 41.5 at 8 bits), a step of the
// embedded model at `--cpu-precision exact` 8.4-8.8 ms against 9.0-9.5; R = 2 or 4 less.
template <int Bits, bool Exact, int R, class I = Isa>
inline void one_row_block(const Quantized& q, const float* x, int n, float* out) {
  typename I::V acc[R];
  for (int r = 0; r < R; r++) acc[r] = I::zero();
  const uint8_t* rows[R];
  for (int r = 0; r < R; r++) rows[r] = row_bytes(q, n + r);
  for_each_group<Bits, R>(
      q, n, [&](int g, const typename I::V(&scale)[R], const typename I::V(&bias)[R]) {
        for (int k = g * q.group; k < (g + 1) * q.group; k += 32)
          for (int i = 0; i < kChunkVectors; i++) {
            const typename I::V xv = I::load(x + k + i * I::kLanes);
            for (int r = 0; r < R; r++) {
              const typename I::V codes = I::template code_vector<Bits>(rows[r] + k * Bits / 8, i);
              acc[r] = I::fma(dequantized<Exact, I>(codes, scale[r], bias[r]), xv, acc[r]);
            }
          }
      });
  for (int r = 0; r < R; r++) out[r] = I::sum(acc[r]);
}

// out[:, n0:n1] for the P (at most 8) rows of x, weight rows R at a time: as many as keep the
// accumulators in registers.
template <int Bits, bool Exact, int P, class I = Isa>
void fused_rows_bits(const Quantized& q, const float* x, float* out, int N, int n0, int n1) {
  int n = n0;
  if constexpr (P == 1 && requires { I::kOneRowR; }) {
    for (; n + I::kOneRowR <= n1; n += I::kOneRowR)
      one_row_block<Bits, Exact, I::kOneRowR>(q, x, n, out + n);
    for (; n < n1; n++) one_row_block<Bits, Exact, 1>(q, x, n, out + n);
    return;
  }
  constexpr int R = P <= 4 ? Isa::kFusedR : Isa::kFusedR / 2;
  for (; n + R <= n1; n += R) fused_block<Bits, Exact, P, R>(q, x, n, out + n, N);
  for (; n < n1; n++) fused_block<Bits, Exact, P, 1>(q, x, n, out + n, N);
}

template <int P>
void fused_rows(const Quantized& q, const float* x, float* out, int N, int n0, int n1) {
  with_type(q, [&](auto bits, auto exact) {
    fused_rows_bits<decltype(bits)::value, decltype(exact)::value, P>(q, x, out, N, n0, n1);
  });
}

// out[m, r] = x[m, :] . tile[r, :] for m < P, r < R: `block`'s sums, reduced sixteen at a
// time (Isa::sums16, the same bits as one at a time).
template <int P, int R>
inline void tile_block(const Seg& seg, float* out, int ldo) {
  typename Isa::V acc[R][P];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) acc[r][m] = Isa::zero();
  accumulate<P, R, false>(acc, seg);
  const typename Isa::V zero = Isa::zero();
  constexpr int kOutputs = P * R;
#pragma GCC unroll 4
  for (int i0 = 0; i0 < kOutputs; i0 += 16) {
    typename Isa::V v[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) v[i] = i0 + i < kOutputs ? acc[(i0 + i) % R][(i0 + i) / R] : zero;
    float sums[16];
    Isa::sums16(v, sums);
    for (int i = i0; i < std::min(i0 + 16, kOutputs); i++)
      out[static_cast<size_t>(i / R) * ldo + i % R] = sums[i - i0];
  }
}

// The last `rows` (< P) rows of x against R rows of a tile.
template <int P, int R>
inline void tile_last_rows(int rows, const Seg& seg, float* out, int ldo) {
  if constexpr (P > 1) {
    if (rows == P - 1)
      tile_block<P - 1, R>(seg, out, ldo);
    else
      tile_last_rows<P - 1, R>(rows, seg, out, ldo);
  }
}

// Rows [0, M) of x against the T dequantized rows of a tile, into out [M, ldo]: blocks of P
// rows of x outermost, so each stays in L1 while the whole tile passes it.
template <int P, int R>
void tile_rows(const float* x, const float* tile, int K, int T, float* out, int M, int ldo) {
  for (int m = 0; m < M; m += P) {
    const int rows = std::min(P, M - m);
    const float* xm = x + static_cast<size_t>(m) * K;
    float* om = out + static_cast<size_t>(m) * ldo;
    int t = 0;
    for (; t + R <= T; t += R) {
      const Seg seg{xm, tile + static_cast<size_t>(t) * K, K};
      if (rows == P)
        tile_block<P, R>(seg, om + t, ldo);
      else
        tile_last_rows<P, R>(rows, seg, om + t, ldo);
    }
    for (; t < T; t++) {
      const Seg seg{xm, tile + static_cast<size_t>(t) * K, K};
      if (rows == P)
        tile_block<P, 1>(seg, om + t, ldo);
      else
        tile_last_rows<P, 1>(rows, seg, om + t, ldo);
    }
  }
}

// out[:, n0:n1] of x @ dequantize(q).T; out is [M, N]. `tile` holds `tile_floats` floats (a
// `QuantRange`).
inline void quant_matmul_range(const Quantized& q, const float* x, float* out, int M, int N, int n0,
                               int n1, float* tile, int tile_floats) {
  switch (M) {  // a decode step's few rows: the weights dequantized in registers
    case 1: return fused_rows<1>(q, x, out, N, n0, n1);
    case 2: return fused_rows<2>(q, x, out, N, n0, n1);
    case 3: return fused_rows<3>(q, x, out, N, n0, n1);
    case 4: return fused_rows<4>(q, x, out, N, n0, n1);
    case 5: return fused_rows<5>(q, x, out, N, n0, n1);
    case 6: return fused_rows<6>(q, x, out, N, n0, n1);
    case 7: return fused_rows<7>(q, x, out, N, n0, n1);
    case 8: return fused_rows<8>(q, x, out, N, n0, n1);
    default: break;
  }
  const int K = q.K;
  constexpr int R = Isa::kTileR;
  const int T = std::max(R, tile_floats / K / R * R);
  for (int n = n0; n < n1; n += T) {
    const int rows = std::min(T, n1 - n);
    dequantize_tile(q, n, rows, tile);
    tile_rows<Isa::kTileP, Isa::kTileR>(x, tile, K, rows, out + n, M, N);
  }
}
