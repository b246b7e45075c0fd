// `x @ dequantize(w).T` for packed quantized weights on int8 activations, written once for every
// ISA: included inside an ISA's namespace, under its target, after its integer traits (`Int8`,
// kernels/isa/*.h) and kernels/quant_matmul.h; each inclusion is another ISA, so no include
// guard.
//
// MLX's affine value is scale * q + bias a group, so a group's part of a row's product is
// scale * sum(q * x) + bias * sum(x). With each block of 32 of x quantized as d * xq (xq int8,
// kernels/quantize_rows.h), sum(q * x) ~ d * sum(q * xq), an exact integer sum that one or two
// instructions take a vector at a time (llama.cpp's q4_1 x q8_1 product). Each output of a row
// is then, in this order:
//   the blocks in order, each (scale * d) * its integer sums added in Int8::kLanes float lanes;
//   the groups in order, each bias * the group's sum of its quantized values, added in lanes too;
//   the lanes summed.
// That sequence depends on the row's own values alone: a row's result is the same bits alone, in
// a batch of any size and in any chunking of its prompt. Where each value of x is three int8
// parts (QuantizedRows::parts, `--cpu-precision exact`), a block's integer sums are three, one a
// part, taken with the same codes and made one value (`parts_sum`) before the scales multiply
// it: x then carries about float32's precision, and the products take integer instructions
// still. At 8 bits a code q is taken as q - 128
// (a signed byte, so that no product of two bytes saturates) and its group's bias as
// bias + 128 * scale: the same product of the quantized row.

// kernels/quant_types.h's group sizes as blocks of 32, at most this many a row: K up to 65536.
constexpr int kInt8MaxGroups = 2048;

// `count` scales or biases from element `at` as float32 (Quantized::dtype: 0 float32, 1 float16,
// 2 bfloat16): float16's Int8::kLanes at a time, exactly.
inline void int8_floats(const void* p, size_t at, int count, int dtype, float* out) {
  int i = 0;
  const auto* halves = static_cast<const uint16_t*>(p) + at;
  if (dtype == 0) {
    std::memcpy(out, static_cast<const float*>(p) + at, sizeof(float) * count);
    return;
  }
  if (dtype == 1)
    for (; i + Int8::kLanes <= count; i += Int8::kLanes)
      Int8::store(out + i, Int8::load_half(halves + i));
  for (; i < count; i++) {
    if (dtype == 1) {
      out[i] = Isa::half_to_float(halves[i]);
    } else {
      const uint32_t bits = static_cast<uint32_t>(halves[i]) << 16;
      std::memcpy(out + i, &bits, sizeof bits);
    }
  }
}

// Weight row n's scales and biases as float32 (at 8 bits the bias of q - 128).
template <int Bits>
inline void int8_params(const Quantized& q, int n, float* scales, float* biases) {
  const int groups = q.K / q.group;
  const size_t at = static_cast<size_t>(n) * groups;
  int8_floats(q.scales, at, groups, q.dtype, scales);
  int8_floats(q.biases, at, groups, q.dtype, biases);
  if constexpr (Bits == 8)
    for (int g = 0; g < groups; g++) biases[g] = std::fma(128.0f, scales[g], biases[g]);
}

// The biases' part of a row's outputs: sum over g of biases[g] * sums[g], added into `acc`.
inline typename Int8::V int8_offsets(const float* biases, const float* sums, int groups,
                                     typename Int8::V acc) {
  int g = 0;
  for (; g + Int8::kLanes <= groups; g += Int8::kLanes)
    acc = Int8::fma(Int8::load(biases + g), Int8::load(sums + g), acc);
  if (g < groups)
    acc = Int8::fma(Int8::load_first(biases + g, groups - g),
                    Int8::load_first(sums + g, groups - g), acc);
  return acc;
}

// A block's integer sums of x's Parts parts (`s(p)`: part p's, as floats) as one value in
// units of its d: quantize_rows.h's `parts_value`, the same operations a lane.
template <class I, int Parts, typename S>
inline typename I::V parts_sum(S s) {
  static_assert(Parts == 1 || Parts == 3, "one int8 code a value, or three parts");
  if constexpr (Parts == 1) {
    return s(0);
  } else {
    const typename I::V inverse = I::set1(1.0f / kPartScale);
    return I::fma(I::fma(s(2), inverse, s(1)), inverse, s(0));
  }
}

// f(std::integral_constant<int, Parts>{}) for x's parts a value.
template <typename F>
inline void with_parts(const QuantizedRows& x, F f) {
  if (x.parts == 3)
    f(std::integral_constant<int, 3>{});
  else
    f(std::integral_constant<int, 1>{});
}

// out[m, r] for the P rows of x and the R weight rows from n; out's rows are `ldo` apart.
template <int Bits, int P, int R, int Parts>
inline void int8_block(const Quantized& q, const QuantizedRows& x, int n, float* out, int ldo) {
  const int K = q.K, blocks = K / 32, groups = K / q.group, per_group = q.group / 32;
  const uint8_t* rows[R];
  float scales[R][kInt8MaxGroups], biases[R][kInt8MaxGroups];
  for (int r = 0; r < R; r++) {
    rows[r] = reinterpret_cast<const uint8_t*>(q.w) + static_cast<size_t>(n + r) * K * Bits / 8;
    int8_params<Bits>(q, n + r, scales[r], biases[r]);
  }
  typename Int8::V acc[R][P];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) acc[r][m] = Int8::zero();
  const uint8_t* ahead = rows[0] + static_cast<size_t>(R) * K * Bits / 8 + kPrefetchBytes;
  for (int b = 0; b < blocks; b++) {
    const int g = b / per_group;
    prefetch_ahead(ahead + static_cast<size_t>(b) * R * 4 * Bits, R * 4 * Bits);
    typename Int8::Codes codes[R];
    typename Int8::V scale[R];
    for (int r = 0; r < R; r++) {
      codes[r] = Int8::template codes<Bits>(rows[r] + b * 4 * Bits);
      scale[r] = Int8::set1(scales[r][g]);
    }
    for (int m = 0; m < P; m++) {
      const size_t at = static_cast<size_t>(m) * blocks + b;
      const int8_t* xb = x.q + at * 32 * Parts;
      const typename Int8::V d = Int8::set1(x.d[at]);
      for (int r = 0; r < R; r++) {  // (scale * d), rounded once, times the block's integer sums
        const typename Int8::V sums = parts_sum<Int8, Parts>([&](int p) {
          return Int8::template dot<Bits>(codes[r], Int8::activations(xb + 32 * p));
        });
        acc[r][m] = Int8::fma(sums, Int8::mul(scale[r], d), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) {
      const float* sums = x.sums + static_cast<size_t>(m) * groups;
      out[static_cast<size_t>(m) * ldo + r] =
          Int8::sum(int8_offsets(biases[r], sums, groups, acc[r][m]));
    }
}

// out[:, n0:n1] for P rows of x, R weight rows at a time (Int8's register blocks).
template <int Bits, int P, int Parts>
void int8_rows(const Quantized& q, const QuantizedRows& x, float* out, int N, int n0, int n1) {
  constexpr int R = P == 1 ? Int8::kR1 : Int8::kR;
  int n = n0;
  for (; n + R <= n1; n += R) int8_block<Bits, P, R, Parts>(q, x, n, out + n, N);
  for (; n < n1; n++) int8_block<Bits, P, 1, Parts>(q, x, n, out + n, N);
}

// out[:, n0:n1] of x @ dequantize(q).T from x's M rows quantized (kernels/quantize_rows.h);
// out is [M, N]. Rows of x P at a time, then one at a time: each output's operations are the
// same either way.
void int8_matmul_range(const Quantized& q, const QuantizedRows& x, float* out, int M, int N, int n0,
                       int n1) {
  with_quant_bits(q.bits, [&](auto bits) {
    with_parts(x, [&](auto parts) {
      constexpr int P = Int8::kP;
      int m = 0;
      for (; m + P <= M; m += P)
        int8_rows<bits, P, parts>(q, x.row(m, q.K, q.group), out + static_cast<size_t>(m) * N, N,
                                  n0, n1);
      for (; m < M; m++)
        int8_rows<bits, 1, parts>(q, x.row(m, q.K, q.group), out + static_cast<size_t>(m) * N, N,
                                  n0, n1);
    });
  });
}

// The same product for weights whose rows are interleaved by eight at load (`Quantized::rows8`),
// so that one vector's eight 32-bit lanes are eight weight rows and a block's integer sums of
// those rows come out in one vector, not one each: about half the operations a weight. Weight
// rows 8G..8G+7 (G a group of eight), block b of 32 codes, take 32 * bits bytes at
// (G * K / 32 + b) * 32 * bits. At 4 bits byte 32j + 4i + k holds row 8G+i's code 8j+k in its low
// half and its code 8j+4+k in its high half (j, k < 4, i < 8); at 8 bits byte 32j + 4i + k holds
// row 8G+i's code 4j+k (j < 8) as q - 128 (`signed_codes`), the group's bias then taken as
// bias + 128 * scale. At 5 and 6 bits (a GGUF's Q5 layers, MLX's 5- and 6-bit ones, widened to 8
// bits at load and laid out at their width again) the block's first 128 bytes are its codes' low
// four bits as at 4 bits, then bits - 4 planes of 32 bytes each, one a code bit from 4 up: byte
// 4i + k of plane p holds in its bit j bit 4 + p of row 8G+i's code 4j+k. Their scales and biases,
// group g, are the eight at (G * K / group + g) * 8. x's rows are quantized in plain order. Each
// output of a row is then, in this order: the blocks in order, each (scale * d) * its integer sum
// added in one float lane; the groups in order, each bias * the group's sum of x's quantized
// values. That sequence depends on the row's own values alone, as the other layout's does.
// Each layout by its codes' bits (kernels/types.h's rows8_planes).
enum class Rows8 { kBits4 = 4, kBits5 = 5, kBits6 = 6, kSigned8 = 8 };

// One block's integer sums of eight rows of signed 8-bit codes for a row of x (`xq`, its
// block's 32 codes), where I has no four-byte products (`rows8_unpacks`): a code's product takes
// its sign onto x's bytes (`signs_of`), so the codes are read again for each row of x and part.
template <class I>
inline typename I::Codes rows8_signed_sums(const uint8_t* codes, size_t stride, const int8_t* xq) {
  typename I::Codes sums = I::zero32();
  for (int j = 0; j < 8; j++) {
    const typename I::Codes c = I::load_bytes(codes + 32 * j, stride);
    sums = I::add32(
        sums, I::widen(I::pairs4(I::magnitudes(c), I::signs_of(I::broadcast4(xq + 4 * j), c))));
  }
  return sums;
}

// Whether I's integer products take a block of signed codes through `Rows8Codes`: where four
// products of an unsigned byte and a signed one go into a lane at once (VNNI), the code c as the
// byte c + 128, whose sums exceed c's by 128 * the sum of x's codes, an exact integer taken back
// (`QuantizedRows::block_sums`). AVX2's pairs of such products would saturate 16 bits.
template <class I, Rows8 Kind>
constexpr bool rows8_unpacks() {
  if constexpr (Kind == Rows8::kSigned8) return requires {
      I::kDotBytes;
    };
  else
    return true;
}

// A block's codes of the eight rows (and where a vector holds several groups of eight, theirs),
// loaded and unpacked once for every row of x and every part of its values: `v[i]` pairs with
// x's four activations from 4 * i. 4-bit codes, 5- and 6-bit ones (their low four bits, each
// plane's bit set in place), and signed ones where `rows8_unpacks` (as c + 128); else a signed
// code's product takes its own sign onto x's bytes, row by row (`rows8_signed_sums`).
template <class I, Rows8 Kind>
struct Rows8Codes {
  static_assert(rows8_unpacks<I, Kind>(), "AVX2's signed codes are read by rows8_signed_sums");
  typename I::Codes v[8];
  Rows8Codes(const uint8_t* codes, size_t stride) {
    constexpr int kPlanes = rows8_planes(static_cast<int>(Kind));
    constexpr bool kNibbles = Kind != Rows8::kSigned8;
    for (int j = 0; j < (kNibbles ? 4 : 8); j++) {
      const typename I::Codes c = I::load_bytes(codes + 32 * j, stride);
      if constexpr (kNibbles)
        v[2 * j] = I::low4(c), v[2 * j + 1] = I::high4(c);
      else
        v[j] = I::flip_signs(c);  // c + 128 as an unsigned byte
    }
    if constexpr (kPlanes > 0) {
      const auto plane = [&]<int P>(std::integral_constant<int, P>) {
        const typename I::Codes bits = I::load_bytes(codes + 128 + 32 * P, stride);
        [&]<int... J>(std::integer_sequence<int, J...>) {
          ((v[J] = I::or_bits(v[J], I::template bit_as<J, 4 + P>(bits))), ...);
        }
        (std::make_integer_sequence<int, 8>{});
      };
      plane(std::integral_constant<int, 0>{});
      if constexpr (kPlanes > 1) plane(std::integral_constant<int, 1>{});
    }
  }
  // The block's integer sums of the rows for one row of x (`xq`, its block's 32 codes): at 4
  // bits at most 2 * 15 * 127 a 16-bit half of `pairs4`, eight such sums within 16 bits; at 5
  // and 6 bits two.
  typename I::Codes sums(const int8_t* xq) const {
    if constexpr (requires { I::kDotBytes; }) {  // four products into each lane at once
      // Two sums, so that each instruction waits on the one before the last, not the last.
      typename I::Codes acc[2] = {I::zero32(), I::zero32()};
      for (int i = 0; i < 8; i++)
        acc[i % 2] = I::dot_bytes(acc[i % 2], v[i], I::broadcast4(xq + 4 * i));
      return I::add32(acc[0], acc[1]);
    } else if constexpr (Kind == Rows8::kBits4) {
      typename I::Codes acc = I::zero16();  // eight sums of two products: within 16 bits
      for (int i = 0; i < 8; i += 2)
        acc = I::add16(acc, I::add16(I::pairs4(v[i], I::broadcast4(xq + 4 * i)),
                                     I::pairs4(v[i + 1], I::broadcast4(xq + 4 * i + 4))));
      return I::widen(acc);
    } else {
      typename I::Codes acc = I::zero32();
      for (int i = 0; i < 8; i += 2)
        acc = I::add32(acc, I::widen(I::add16(I::pairs4(v[i], I::broadcast4(xq + 4 * i)),
                                              I::pairs4(v[i + 1], I::broadcast4(xq + 4 * i + 4)))));
      return acc;
    }
  }
};

// Groups of eight weight rows a vector of I holds: one, or where its vectors are wider, as many
// as they hold side by side (I::kGroups), each lane's operations the same.
template <class I>
constexpr int rows8_groups() {
  if constexpr (requires { I::kGroups; })
    return I::kGroups;
  else
    return 1;
}

template <class I, Rows8 Kind, int Dtype, int P, int Parts>
inline void int8_rows8_block(const Quantized& q, const QuantizedRows& x, int G, float* out,
                             int ldo) {
  constexpr int kBlockBytes = 32 * static_cast<int>(Kind);
  const int K = q.K, blocks = K / 32, groups = K / q.group, per_group = q.group / 32;
  const size_t stride = static_cast<size_t>(blocks) * kBlockBytes;  // from group G to G + 1
  const size_t params_stride = static_cast<size_t>(groups) * 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(q.w) + static_cast<size_t>(G) * stride;
  const size_t params = static_cast<size_t>(G) * params_stride;
  typename I::V acc[P];
  for (int m = 0; m < P; m++) acc[m] = I::zero();
  typename I::V scale = I::zero();
  for (int b = 0; b < blocks; b++) {
    if (b % per_group == 0)
      scale = I::template load8<Dtype>(q.scales, params + b / per_group * 8, params_stride);
    const uint8_t* codes = w + static_cast<size_t>(b) * kBlockBytes;
    for (int i = 0; i < rows8_groups<I>(); i++)
      prefetch_ahead(codes + i * stride + kRows8PrefetchBytes, kBlockBytes);
    // sums_of(part p's 32 codes, its index in x.block_sums): the block's integer sums.
    const auto block = [&](auto sums_of) {
      for (int m = 0; m < P; m++) {
        const size_t at = static_cast<size_t>(m) * blocks + b;
        const int8_t* xb = x.q + at * 32 * Parts;
        const typename I::V sums = parts_sum<I, Parts>(
            [&](int p) { return I::to_float(sums_of(xb + 32 * p, at * Parts + p)); });
        acc[m] = I::fma(sums, I::mul(scale, I::set1(x.d[at])), acc[m]);
      }
    };
    if constexpr (!rows8_unpacks<I, Kind>()) {
      block([&](const int8_t* xq, size_t) { return rows8_signed_sums<I>(codes, stride, xq); });
    } else {
      const Rows8Codes<I, Kind> unpacked(codes, stride);
      block([&](const int8_t* xq, size_t at) {
        if constexpr (Kind == Rows8::kSigned8)  // the codes were taken as c + 128
          return I::sub32(unpacked.sums(xq), I::set32(128 * x.block_sums[at]));
        else
          return unpacked.sums(xq);
      });
    }
  }
  for (int g = 0; g < groups; g++) {
    typename I::V bias = I::template load8<Dtype>(q.biases, params + g * 8, params_stride);
    if constexpr (Kind == Rows8::kSigned8)
      bias = I::fma(I::set1(128.0f),
                    I::template load8<Dtype>(q.scales, params + g * 8, params_stride), bias);
    for (int m = 0; m < P; m++)
      acc[m] = I::fma(bias, I::set1(x.sums[static_cast<size_t>(m) * groups + g]), acc[m]);
  }
  for (int m = 0; m < P; m++) I::store(out + static_cast<size_t>(m) * ldo, acc[m]);
}

// out[:, n0:n1] (n0 and n1 multiples of 8) of x @ dequantize(q).T for weights interleaved by
// eight (`int8_rows8_block`); out is [M, N]. Rows of x kRows8P at a time, then one at a time:
// each output's operations are the same either way.
template <class I = Int8>
void int8_rows8_range(const Quantized& q, const QuantizedRows& x, float* out, int M, int N, int n0,
                      int n1) {
  constexpr int P = I::kRows8P;
  const auto run = [&](auto kind, auto dtype, auto parts) {
    int m = 0;
    constexpr int kWide = rows8_groups<I>();
    // Groups of eight weight rows a tile: a prompt's rows of x pass a tile's codes while they stay
    // in cache, rather than all of the weights' codes once for every P rows.
    const int row_bytes = q.K * q.bits / 8;
    const int tile = std::max(kWide, kRows8TileBytes / (8 * row_bytes) / kWide * kWide);
    const auto rows = [&](auto p, int G0, int G1) {  // x's rows m.. (p of them), groups G0..G1
      const QuantizedRows xm = x.row(m, q.K, q.group);
      float* at = out + static_cast<size_t>(m) * N;
      int G = G0;
      for (; G + kWide <= G1; G += kWide)
        int8_rows8_block<I, kind, dtype, p, parts>(q, xm, G, at + 8 * G, N);
      for (; G < G1; G++)  // what a wide vector leaves: Int8's, the same lanes' operations
        int8_rows8_block<Int8, kind, dtype, p, parts>(q, xm, G, at + 8 * G, N);
    };
    for (int G0 = n0 / 8; G0 < n1 / 8; G0 += tile) {
      const int G1 = std::min(n1 / 8, G0 + tile);
      for (m = 0; m + P <= M; m += P) rows(std::integral_constant<int, P>{}, G0, G1);
      for (; m < M; m++) rows(std::integral_constant<int, 1>{}, G0, G1);
    }
  };
  const auto with_dtype = [&](auto kind) {
    with_parts(x, [&](auto parts) {
      if (q.dtype == 0)
        run(kind, std::integral_constant<int, 0>{}, parts);
      else if (q.dtype == 1)
        run(kind, std::integral_constant<int, 1>{}, parts);
      else
        run(kind, std::integral_constant<int, 2>{}, parts);
    });
  };
  if (q.bits == 4)
    with_dtype(std::integral_constant<Rows8, Rows8::kBits4>{});
  else if (q.bits == 5)
    with_dtype(std::integral_constant<Rows8, Rows8::kBits5>{});
  else if (q.bits == 6)
    with_dtype(std::integral_constant<Rows8, Rows8::kBits6>{});
  else  // 8 bits, signed (check_packed)
    with_dtype(std::integral_constant<Rows8, Rows8::kSigned8>{});
}

// The table's entry for the interleaved products: null where the ISA's integer traits have none
// (a template, so that the branch not taken is not compiled for them).
template <class I = Int8>
constexpr Int8Range int8_rows8_entry() {
  if constexpr (requires { I::kRows8; })
    return &int8_rows8_range<I>;
  else
    return nullptr;
}
