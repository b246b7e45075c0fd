// The native kernels' float and quantized products on every ISA this machine runs, without MLX:
// each against a plain scalar reference within rounding, and each row's result the same bits
// alone as in a batch; the integer products on int8 activations against the quantized rows'
// own product; their attention against the reference's softmax.
// tests/unit/test_native_kernels.py builds it with the kernels' sources (models/cpu/native/kernels)
// for x86-64 and AArch64 (the latter run under qemu) with the extension's flags; it prints a line
// an ISA and exits 1 on the first wrong result.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "kernels/quantize_rows.h"
#include "kernels/table.h"
#include "kernels/types.h"

namespace {

using hotlora::Int8Rows;
using hotlora::Kernel;
using hotlora::Quantized;
using hotlora::QuantizedRows;
using hotlora::Seg;

std::mt19937 g_random(7);

std::vector<float> normal(size_t n) {
  std::normal_distribution<float> value(0.0f, 1.0f);
  std::vector<float> out(n);
  for (auto& v : out) v = value(g_random);
  return out;
}

[[noreturn]] void fail(const char* isa, const char* what, int M, int K, int N, int m, int n,
                       double got, double want) {
  std::printf("%s: %s wrong at M=%d K=%d N=%d, row %d column %d: %.9g, expected %.9g\n", isa, what,
              M, K, N, m, n, got, want);
  std::exit(1);
}

// got [M, N] against want [M, N], each within float32's rounding of its sum's magnitude.
void check_close(const char* isa, const char* what, const std::vector<float>& got,
                 const std::vector<double>& want, const std::vector<double>& magnitude, int M,
                 int K, int N) {
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      const size_t i = static_cast<size_t>(m) * N + n;
      if (std::abs(got[i] - want[i]) > 1e-5 * magnitude[i] + 1e-6)
        fail(isa, what, M, K, N, m, n, got[i], want[i]);
    }
}

// Row m of `batch` [M, N] is the bits of `alone` [N].
void check_row_bits(const char* isa, const char* what, const std::vector<float>& batch,
                    const std::vector<float>& alone, int M, int K, int N, int m) {
  if (std::memcmp(batch.data() + static_cast<size_t>(m) * N, alone.data(), sizeof(float) * N) != 0)
    for (int n = 0; n < N; n++)
      if (std::memcmp(&batch[static_cast<size_t>(m) * N + n], &alone[n], sizeof(float)) != 0)
        fail(isa, what, M, K, N, m, n, batch[static_cast<size_t>(m) * N + n], alone[n]);
}

// x [M, K] @ w [N, K].T (+ h [M, R] @ b_t [N, R].T), as the extension's RowsMatmul calls the
// kernel: weight rows split in two ranges on a multiple of 4, as its threads split them.
std::vector<float> float_product(const Kernel& kernel, const float* x, const float* w,
                                 const float* h, const float* b_t, int M, int K, int N, int R) {
  std::vector<float> out(static_cast<size_t>(M) * N);
  const Seg extra = R > 0 ? Seg{h, b_t, R} : Seg{};
  const int split = N / 2 - N / 2 % 4;
  kernel.range(Seg{x, w, K}, extra, out.data(), M, N, 0, split);
  kernel.range(Seg{x, w, K}, extra, out.data(), M, N, split, N);
  return out;
}

void check_float(const Kernel& kernel, int M, int K, int N, int R) {
  const auto x = normal(static_cast<size_t>(M) * K), w = normal(static_cast<size_t>(N) * K);
  const auto h = normal(static_cast<size_t>(M) * R), b_t = normal(static_cast<size_t>(N) * R);
  const auto out = float_product(kernel, x.data(), w.data(), h.data(), b_t.data(), M, K, N, R);
  std::vector<double> want(out.size()), magnitude(out.size());
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      double sum = 0, size = 0;
      for (int k = 0; k < K; k++) {
        const double p = static_cast<double>(x[static_cast<size_t>(m) * K + k]) *
                         w[static_cast<size_t>(n) * K + k];
        sum += p, size += std::abs(p);
      }
      for (int r = 0; r < R; r++) {
        const double p = static_cast<double>(h[static_cast<size_t>(m) * R + r]) *
                         b_t[static_cast<size_t>(n) * R + r];
        sum += p, size += std::abs(p);
      }
      want[static_cast<size_t>(m) * N + n] = sum, magnitude[static_cast<size_t>(m) * N + n] = size;
    }
  const char* what = R > 0 ? "float product with LoRA" : "float product";
  check_close(kernel.isa, what, out, want, magnitude, M, K, N);
  for (int m = 0; m < M; m++) {
    const auto alone = float_product(kernel, x.data() + static_cast<size_t>(m) * K, w.data(),
                                     h.data() + static_cast<size_t>(m) * R, b_t.data(), 1, K, N, R);
    check_row_bits(kernel.isa, what, out, alone, M, K, N, m);
  }
}

// A scale or bias of `dtype` (0 float32, 1 float16, 2 bfloat16): a value each of the three holds
// exactly, +-(1 + j / 128) * 2^e, with its bits in the dtype (the low 16 bits for the halves).
struct Param {
  float value;
  uint32_t bits;
};

Param quant_param_value(int dtype, bool negative, int e, int j) {
  const float value = (negative ? -1.0f : 1.0f) * (1.0f + j / 128.0f) * std::ldexp(1.0f, e);
  uint32_t bits;
  if (dtype == 1)
    bits = (negative ? 0x8000u : 0u) | static_cast<uint32_t>(e + 15) << 10 |
           static_cast<uint32_t>(j) << 3;
  else
    std::memcpy(&bits, &value, sizeof bits);
  if (dtype == 2) bits >>= 16;
  return {value, bits};
}

// Weights [N, K] of `bits` bits in MLX's affine layout, with their dequantized values.
struct QuantWeights {
  std::vector<uint32_t> words;
  std::vector<uint8_t> scales, biases;  // [N, K / group] of the dtype's width
  std::vector<float> dequantized;       // [N, K]: scale * q + bias, two roundings
  Quantized q;
};

// `levels`: the codes drawn under it (0: every code of `bits`), as 5- and 6-bit codes widened to
// 8 bits.
QuantWeights quantized(int N, int K, int bits, int group, int dtype, int levels = 0) {
  QuantWeights out;
  const int groups = K / group, width = dtype == 0 ? 4 : 2;
  out.words.assign(static_cast<size_t>(N) * K * bits / 32, 0);
  out.scales.resize(static_cast<size_t>(N) * groups * width);
  out.biases.resize(out.scales.size());
  out.dequantized.resize(static_cast<size_t>(N) * K);
  std::uniform_int_distribution<int> level(0, (levels ? levels : 1 << bits) - 1), mantissa(0, 127);
  for (int n = 0; n < N; n++)
    for (int g = 0; g < groups; g++) {
      const size_t at = static_cast<size_t>(n) * groups + g;
      const Param scale = quant_param_value(dtype, false, bits == 4 ? -4 : -7, mantissa(g_random));
      const Param bias = quant_param_value(dtype, true, -1, mantissa(g_random));
      std::memcpy(out.scales.data() + at * width, &scale.bits, width);
      std::memcpy(out.biases.data() + at * width, &bias.bits, width);
      for (int k = g * group; k < (g + 1) * group; k++) {
        const auto value = static_cast<uint32_t>(level(g_random));
        const size_t bit = (static_cast<size_t>(n) * K + k) * bits;
        out.words[bit / 32] |= value << (bit % 32);  // the lowest bits first
        const float product = scale.value * static_cast<float>(value);
        out.dequantized[static_cast<size_t>(n) * K + k] = product + bias.value;
      }
    }
  out.q = Quantized{out.words.data(), out.scales.data(), out.biases.data(), K, bits, group, dtype};
  return out;
}

// x [M, K] @ dequantize(w).T, then each row's residual over the columns listed for it: the
// quantized product and add_residuals as the extension's primitives call them, weight rows in two
// ranges, tiles by the row count.
std::vector<float> quant_product(const Kernel& kernel, const Quantized& q, const float* x,
                                 const float* h, const float* b, const std::vector<int>& columns,
                                 const std::vector<int>& counts, int M, int N, int R) {
  std::vector<float> out(static_cast<size_t>(M) * N);
  const int tile_floats = M <= 16 ? 8192 : 32768;
  std::vector<float> tile(std::max<size_t>(tile_floats, 4 * static_cast<size_t>(q.K)));
  const int split = N / 2 - N / 2 % 4;
  for (const auto& [n0, n1] : {std::pair{0, split}, std::pair{split, N}}) {
    kernel.quant(q, x, out.data(), M, N, n0, n1, tile.data(), tile_floats);
    for (int m = 0; m < M && R > 0; m++)
      if (counts[m] > 0) {
        const float* row_h = h + static_cast<size_t>(m) * R;
        float* row_out = out.data() + static_cast<size_t>(m) * N;
        kernel.residuals(&row_h, b, N, columns.data() + static_cast<size_t>(m) * R, counts[m],
                         &row_out, 1, n0, n1);
      }
  }
  return out;
}

void check_quant(const Kernel& kernel, int M, int K, int N, int bits, int group, int dtype, int R) {
  const auto w = quantized(N, K, bits, group, dtype);
  const auto x = normal(static_cast<size_t>(M) * K);
  const auto h = normal(static_cast<size_t>(M) * R), b = normal(static_cast<size_t>(R) * N);
  // Row m keeps the columns r with (r + m) % 3 != 0, and every third row none: rows of other
  // adapters, and rows of the base alone, in one batch.
  std::vector<int> columns(static_cast<size_t>(M) * R), counts(M, 0);
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R && m % 3 != 2; r++)
      if ((r + m) % 3 != 0) columns[static_cast<size_t>(m) * R + counts[m]++] = r;
  const auto out =
      quant_product(kernel, w.q, x.data(), h.data(), b.data(), columns, counts, M, N, R);
  std::vector<double> want(out.size()), magnitude(out.size());
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      double sum = 0, size = 0;
      for (int k = 0; k < K; k++) {
        const double p = static_cast<double>(x[static_cast<size_t>(m) * K + k]) *
                         w.dequantized[static_cast<size_t>(n) * K + k];
        sum += p, size += std::abs(p);
      }
      for (int i = 0; i < counts[m]; i++) {
        const int r = columns[static_cast<size_t>(m) * R + i];
        const double p = static_cast<double>(h[static_cast<size_t>(m) * R + r]) *
                         b[static_cast<size_t>(r) * N + n];
        sum += p, size += std::abs(p);
      }
      want[static_cast<size_t>(m) * N + n] = sum, magnitude[static_cast<size_t>(m) * N + n] = size;
    }
  char what[96];
  std::snprintf(what, sizeof what, "%d-bit product (group %d, dtype %d%s)", bits, group, dtype,
                R > 0 ? ", LoRA" : "");
  check_close(kernel.isa, what, out, want, magnitude, M, K, N);
  for (int m = 0; m < M; m++) {
    const std::vector<int> own(columns.begin() + static_cast<ptrdiff_t>(m) * R,
                               columns.begin() + static_cast<ptrdiff_t>(m + 1) * R);
    const auto alone =
        quant_product(kernel, w.q, x.data() + static_cast<size_t>(m) * K,
                      h.data() + static_cast<size_t>(m) * R, b.data(), own, {counts[m]}, 1, N, R);
    check_row_bits(kernel.isa, what, out, alone, M, K, N, m);
  }
}

// Weights [N, K] (N a multiple of 8) with their rows interleaved by eight, as the integer
// kernel's `int8_rows8_range` reads them (kernels/int8_matmul.h): 8-bit codes as signed q - 128;
// or, `narrow` 5 or 6, 8-bit codes under 2^narrow as their low four bits (the 4-bit layout's)
// and narrow - 4 planes of their higher bits.
struct InterleavedWeights {
  std::vector<uint8_t> codes, scales, biases;
  Quantized q;
};

InterleavedWeights interleaved(const QuantWeights& w, int N, int narrow = 0) {
  const Quantized& plain = w.q;
  const int K = plain.K, bits = narrow ? narrow : plain.bits, blocks = K / 32;
  const int groups = K / plain.group;
  const int width = plain.dtype == 0 ? 4 : 2, block_bytes = 32 * bits;
  InterleavedWeights out;
  out.codes.resize(static_cast<size_t>(N) * K * bits / 8);
  out.scales.resize(w.scales.size());
  out.biases.resize(w.biases.size());
  const auto code = [&](int n, int k) {
    const size_t bit = (static_cast<size_t>(n) * K + k) * plain.bits;
    return static_cast<uint8_t>(w.words[bit / 32] >> (bit % 32) & ((1u << plain.bits) - 1));
  };
  for (int n = 0; n < N && narrow; n++)
    for (int k = 0; k < K; k++)
      if (code(n, k) >= 1 << narrow)
        fail("check", "codes under 2^narrow", N, K, narrow, n, k, 0, 0);
  const bool signed_codes = bits == 8;
  for (int G = 0; G < N / 8; G++)
    for (int i = 0; i < 8; i++) {
      for (int b = 0; b < blocks; b++)
        for (int j = 0; j < block_bytes / 32; j++)
          for (int k = 0; k < 4; k++) {
            const size_t at =
                (static_cast<size_t>(G) * blocks + b) * block_bytes + 32 * j + 4 * i + k;
            if (bits <= 6 &&
                j >= 4) {  // plane j - 4: bit 4 + j - 4 of codes 4m + k (m < 8) in bits m
              uint8_t plane = 0;
              for (int m = 0; m < 8; m++)
                plane |= ((code(8 * G + i, 32 * b + 4 * m + k) >> j) & 1) << m;
              out.codes[at] = plane;
            } else if (bits <= 6)
              out.codes[at] = (code(8 * G + i, 32 * b + 8 * j + k) & 15) |
                              static_cast<uint8_t>(code(8 * G + i, 32 * b + 8 * j + 4 + k) << 4);
            else
              out.codes[at] = code(8 * G + i, 32 * b + 4 * j + k) ^ (signed_codes ? 0x80 : 0);
          }
      for (int g = 0; g < groups; g++) {
        const size_t from = (static_cast<size_t>(8 * G + i) * groups + g) * width;
        const size_t to = ((static_cast<size_t>(G) * groups + g) * 8 + i) * width;
        std::memcpy(out.scales.data() + to, w.scales.data() + from, width);
        std::memcpy(out.biases.data() + to, w.biases.data() + from, width);
      }
    }
  out.q = Quantized{reinterpret_cast<const uint32_t*>(out.codes.data()),
                    out.scales.data(),
                    out.biases.data(),
                    K,
                    bits,
                    plain.group,
                    plain.dtype,
                    true,
                    signed_codes};
  return out;
}

// x [M, K] quantized to int8, `parts` codes a value (kernels/quantize_rows.h), @ dequantize(w).T
// by the integer kernel (the interleaved one for `q.rows8`), weight rows in two ranges as the
// primitives' threads split them.
std::vector<float> int8_product(const Kernel& kernel, const Quantized& q, const float* x, int M,
                                int N, int parts) {
  Int8Rows rows(x, M, q.K, q.group, hotlora::halves_first(q), parts);
  rows.quantize(0, M);
  std::vector<float> out(static_cast<size_t>(M) * N);
  const int split = N / 2 - N / 2 % 8;
  const auto product = q.rows8 ? kernel.int8_rows8 : kernel.int8;
  product(q, rows.rows(), out.data(), M, N, 0, split);
  product(q, rows.rows(), out.data(), M, N, split, N);
  return out;
}

// The ISA every other one of its architecture builds on (AVX2, NEON): the last in the table.
const Kernel& baseline() { return *hotlora::kernels().back(); }

// Integer sums are exact and every ISA adds them into floats in one order: its integer products
// are the baseline's bits, whatever instructions take the sums.
void check_baseline_bits(const Kernel& kernel, const char* what, const std::vector<float>& out,
                         const Quantized& q, const float* x, int M, int N, int parts) {
  if (&kernel == &baseline()) return;
  const auto base = int8_product(baseline(), q, x, M, N, parts);
  for (size_t i = 0; i < out.size(); i++)
    if (std::memcmp(&out[i], &base[i], sizeof(float)) != 0)
      fail(kernel.isa, what, M, q.K, N, static_cast<int>(i) / N, static_cast<int>(i) % N, out[i],
           base[i]);
}

// The integer product is the quantized rows' own product with the dequantized weights, within
// float32's rounding: each row's values d * code (each within d / 2 of x, d its block's largest
// magnitude / 127, and float32's rounding of x / d), or with three parts d * (c0 + (c1 + c2 /
// 254) / 254) (within d / 2 / 254^2 and the same rounding), against the weights' values; and a
// row's result is the same bits alone. `levels` as `quantized`'s: 8-bit codes under 32 or 64
// are also checked laid out at 5 and 6 bits.
void check_int8(const Kernel& kernel, int M, int K, int N, int bits, int group, int dtype,
                int parts, int levels = 0) {
  const auto w = quantized(N, K, bits, group, dtype, levels);
  auto x = normal(static_cast<size_t>(M) * K);
  for (int k = 0; k < K; k += 97) x[k] = 0.0f;                // zeros among the values
  std::fill_n(x.begin() + K / 2, std::min(32, K / 2), 0.0f);  // a block of zeros: d = 0
  Int8Rows quantized_x(x.data(), M, K, group, bits == 4, parts);
  quantized_x.quantize(0, M);
  const QuantizedRows rows = quantized_x.rows();
  std::vector<double> values(x.size());  // the quantized rows, in value order
  for (int m = 0; m < M; m++)
    for (int k = 0; k < K; k++) {
      const size_t at = static_cast<size_t>(m) * K + k, block = at / 32;
      const int i = k % 32, stored = bits == 4 ? (i % 2) * 16 + i / 2 : i;
      const double d = rows.d[block];
      double value = 0.0, unit = 1.0;
      for (int p = 0; p < parts; p++, unit /= hotlora::kPartScale) {
        const int8_t code = rows.q[(block * parts + p) * 32 + stored];
        if (code < -127) fail(kernel.isa, "int8 quantization", M, K, N, m, k, code, x[at]);
        value += unit * code;
      }
      values[at] = d * value;
      const double last = unit * hotlora::kPartScale;  // the last part's unit
      // With float32's rounding of x / d: a value just under a half-way point may round onto
      // it, and then to the code past it.
      const double bound = d / 2 * last * (1 + 1e-6) + std::abs(x[at]) * 2.5e-7;
      if (std::abs(values[at] - x[at]) > bound)
        fail(kernel.isa, "int8 quantization", M, K, N, m, k, values[at], x[at]);
    }
  std::vector<double> want(static_cast<size_t>(M) * N), magnitude(want.size());
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      double sum = 0, size = 0;
      for (int k = 0; k < K; k++) {
        const double p =
            values[static_cast<size_t>(m) * K + k] * w.dequantized[static_cast<size_t>(n) * K + k];
        sum += p, size += std::abs(p);
      }
      want[static_cast<size_t>(m) * N + n] = sum, magnitude[static_cast<size_t>(m) * N + n] = size;
    }
  char what[96];
  // The product of the weights as `q` lays them out, checked: against the values, the
  // baseline's bits, and each row's bits alone.
  const auto checked = [&](const Quantized& q) {
    const auto out = int8_product(kernel, q, x.data(), M, N, parts);
    check_close(kernel.isa, what, out, want, magnitude, M, K, N);
    check_baseline_bits(kernel, what, out, q, x.data(), M, N, parts);
    for (int m = 0; m < M; m++) {
      const auto alone =
          int8_product(kernel, q, x.data() + static_cast<size_t>(m) * K, 1, N, parts);
      check_row_bits(kernel.isa, what, out, alone, M, K, N, m);
    }
    return out;
  };
  std::snprintf(what, sizeof what, "%d-bit product on int8 rows of %d parts (group %d, dtype %d)",
                bits, parts, group, dtype);
  checked(w.q);
  if (N % 8 != 0 || kernel.int8_rows8 == nullptr) return;
  // The same product on the rows interleaved by eight: the same values, other float roundings.
  std::snprintf(what, sizeof what,
                "interleaved %d-bit product on int8 rows of %d parts (group %d, dtype %d)", bits,
                parts, group, dtype);
  checked(interleaved(w, N).q);
  // The codes' low four bits and their planes; codes under 32 at 5 bits and at 6, the same
  // integer sums in the same order: the same bits.
  std::vector<float> fives;
  for (int narrow : {5, 6}) {
    if (bits != 8 || levels == 0 || levels > 1 << narrow) continue;
    std::snprintf(what, sizeof what,
                  "%d-bit interleaved product on int8 rows of %d parts (group %d, dtype %d)",
                  narrow, parts, group, dtype);
    const auto out = checked(interleaved(w, N, narrow).q);
    if (narrow == 5) fives = out;
    for (size_t i = 0; i < fives.size() && narrow == 6; i++)
      if (std::memcmp(&out[i], &fives[i], sizeof(float)) != 0)
        fail(kernel.isa, what, M, K, N, static_cast<int>(i) / N, static_cast<int>(i) % N, out[i],
             fives[i]);
  }
}

// attend's G query heads [G, D] against S keys and values, the mask showing `visible` (all,
// some, or none: then every position weighs alike); a hidden position's value is NaN, which
// must stay out.
void check_attention(const Kernel& kernel, int G, int D, int S, int shown) {
  const auto q = normal(static_cast<size_t>(G) * D), k = normal(static_cast<size_t>(S) * D);
  auto v = normal(static_cast<size_t>(S) * D);
  std::vector<char> visible(S);
  for (int s = 0; s < S; s++) visible[s] = shown == 2 || (shown == 1 && s % 3 != 1);
  if (shown > 0)
    for (int s = 0; s < S; s++)
      if (!visible[s]) v[static_cast<size_t>(s) * D] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> scores(static_cast<size_t>(G) * S), out(static_cast<size_t>(G) * D);
  kernel.attend(q.data(), 1, G, D, k.data(), D, v.data(), D, D,
                reinterpret_cast<const bool*>(visible.data()), 1, 0, S, scores.data(), out.data());
  std::vector<double> want(out.size()), magnitude(out.size());
  for (int g = 0; g < G; g++) {
    std::vector<double> weight(S, 0.0);
    double top = -1e300, total = 0;
    for (int s = 0; s < S; s++)
      if (visible[s] || shown == 0) {
        double score = 0;
        for (int d = 0; d < D; d++)
          score += static_cast<double>(q[static_cast<size_t>(g) * D + d]) *
                   k[static_cast<size_t>(s) * D + d];
        weight[s] = shown == 0 ? 0.0 : score;
        top = std::max(top, weight[s]);
      }
    for (int s = 0; s < S; s++)
      if (visible[s] || shown == 0) total += weight[s] = std::exp(weight[s] - top);
    for (int s = 0; s < S; s++)
      for (int d = 0; d < D && (visible[s] || shown == 0); d++) {
        const double term = weight[s] / total * v[static_cast<size_t>(s) * D + d];
        want[static_cast<size_t>(g) * D + d] += term;
        magnitude[static_cast<size_t>(g) * D + d] += std::abs(term);
      }
  }
  for (size_t i = 0; i < out.size(); i++)
    if (!(std::abs(out[i] - want[i]) <= 1e-5 * magnitude[i] + 1e-6))
      fail(kernel.isa, "attention (M: heads, K: head size, N: positions)", G, D, S,
           static_cast<int>(i) / D, static_cast<int>(i) % D, out[i], want[i]);
}

// attend's T query tokens at once (a prompt chunk's, each seeing the positions up to its own,
// one of them none when `blind`), G heads each: every token's result the bits of its call alone.
void check_attention_tokens(const Kernel& kernel, int T, int G, int D, int S, bool blind) {
  const auto q = normal(static_cast<size_t>(T) * G * D), k = normal(static_cast<size_t>(S) * D);
  const auto v = normal(static_cast<size_t>(S) * D);
  std::vector<char> visible(static_cast<size_t>(T) * S);
  for (int t = 0; t < T; t++)
    for (int s = 0; s < S; s++)
      visible[static_cast<size_t>(t) * S + s] = s <= S - T + t && s % 5 != 3 && !(blind && t == 1);
  const auto* flags = reinterpret_cast<const bool*>(visible.data());
  std::vector<float> scores(static_cast<size_t>(T) * G * S), out(static_cast<size_t>(T) * G * D);
  kernel.attend(q.data(), T, G, D, k.data(), D, v.data(), D, D, flags, 1, S, S, scores.data(),
                out.data());
  std::vector<float> alone(static_cast<size_t>(G) * D);
  for (int t = 0; t < T; t++) {
    kernel.attend(q.data() + static_cast<size_t>(t) * G * D, 1, G, D, k.data(), D, v.data(), D, D,
                  flags + static_cast<size_t>(t) * S, 1, 0, S, scores.data(), alone.data());
    for (int i = 0; i < G * D; i++) {
      const float got = out[static_cast<size_t>(t) * G * D + i];
      if (std::memcmp(&got, &alone[i], sizeof got) != 0)
        fail(kernel.isa, "attention of several tokens against each alone (M: tokens, K: heads)", T,
             G, S, t, i, got, alone[i]);
    }
  }
}

// A row's attention after `pad` hidden positions (a batch's left padding, which other rows set)
// is the bits of its attention without them: the keys and values the same, their positions
// shifted.
void check_attention_padding(const Kernel& kernel, int G, int D, int S, int pad) {
  const auto q = normal(static_cast<size_t>(G) * D);
  const auto k = normal(static_cast<size_t>(S) * D), v = normal(static_cast<size_t>(S) * D);
  const int padded = S + pad;
  std::vector<float> k_pad(static_cast<size_t>(padded) * D, 1e30f), v_pad(k_pad.size(), 1e30f);
  std::copy(k.begin(), k.end(), k_pad.begin() + static_cast<size_t>(pad) * D);
  std::copy(v.begin(), v.end(), v_pad.begin() + static_cast<size_t>(pad) * D);
  std::vector<char> visible(S, 1), visible_pad(padded, 0);
  std::fill(visible_pad.begin() + pad, visible_pad.end(), 1);
  std::vector<float> scores(static_cast<size_t>(G) * padded), out(static_cast<size_t>(G) * D),
      out_pad(out.size());
  kernel.attend(q.data(), 1, G, D, k.data(), D, v.data(), D, D,
                reinterpret_cast<const bool*>(visible.data()), 1, 0, S, scores.data(), out.data());
  kernel.attend(q.data(), 1, G, D, k_pad.data(), D, v_pad.data(), D, D,
                reinterpret_cast<const bool*>(visible_pad.data()), 1, 0, padded, scores.data(),
                out_pad.data());
  for (size_t i = 0; i < out.size(); i++)
    if (std::memcmp(&out[i], &out_pad[i], sizeof(float)) != 0)
      fail(kernel.isa, "attention after hidden leading positions (M: heads, K: padding)", G, pad, S,
           static_cast<int>(i) / D, static_cast<int>(i) % D, out_pad[i], out[i]);
}

// A float16 near v (its bits; truncated, normal or zero) and the float it holds exactly: the
// kernels read float16 adapters as these floats.
uint16_t to_half(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const int exponent = std::min(static_cast<int>((bits >> 23) & 0xff) - 127 + 15, 30);
  if (exponent <= 0) return sign;
  return static_cast<uint16_t>(sign | exponent << 10 | ((bits >> 13) & 0x3ff));
}

float from_half(uint16_t half) {
  const uint32_t exponent = (half >> 10) & 0x1f;
  const uint32_t bits = (static_cast<uint32_t>(half & 0x8000) << 16) |
                        (exponent == 0 ? 0 : (exponent - 15 + 127) << 23 | (half & 0x3ffu) << 13);
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// `rows` rows' activations of one adapter in one call, x [K] @ a [K, r] times each row's scale,
// against the scalar sums in the kernel's order: four chains over k, (c0 + c1) + (c2 + c3), then
// the scale. The same bits for each row, for ranks that fill whole vectors, part of one, or both;
// from float16 adapters, the same bits as from the float32 values they hold.
void check_low_rank(const Kernel& kernel, int K, int r, int rows) {
  const auto values = normal(static_cast<size_t>(K) * r);
  std::vector<uint16_t> halves(values.size());
  std::vector<float> a(values.size());
  for (size_t i = 0; i < values.size(); i++)
    halves[i] = to_half(values[i]), a[i] = from_half(halves[i]);
  std::vector<std::vector<float>> x(rows), h(rows), from_halves(rows);
  const float* xs[hotlora::kLoraRows];
  float scales[hotlora::kLoraRows];
  float *hs[hotlora::kLoraRows], *hs_halves[hotlora::kLoraRows];
  for (int g = 0; g < rows; g++) {
    x[g] = normal(K), h[g].resize(r), from_halves[g].resize(r);
    xs[g] = x[g].data(), scales[g] = 0.75f - 0.5f * g;
    hs[g] = h[g].data(), hs_halves[g] = from_halves[g].data();
  }
  kernel.low_rank(xs, a.data(), K, r, scales, hs, rows);
  kernel.low_rank_half(xs, halves.data(), K, r, scales, hs_halves, rows);
  for (int g = 0; g < rows; g++)
    for (int j = 0; j < r; j++) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int k = 0; k < K; k++)
        c[k % 4] = std::fma(x[g][k], a[static_cast<size_t>(k) * r + j], c[k % 4]);
      const float want = ((c[0] + c[1]) + (c[2] + c[3])) * scales[g];
      if (std::memcmp(&h[g][j], &want, sizeof(float)) != 0)
        fail(kernel.isa, "low-rank activations", rows, K, r, g, j, h[g][j], want);
      if (std::memcmp(&from_halves[g][j], &want, sizeof(float)) != 0)
        fail(kernel.isa, "low-rank activations of float16", rows, K, r, g, j, from_halves[g][j],
             want);
    }
  // The residual h @ b [r, N] added to each row, columns [n0, N) (past one block of eight chains
  // on every ISA, then vectors, then values): from float16 b, the bits of its float values; the
  // columns before n0 untouched.
  const int N = 205, n0 = 3;
  const auto b_values = normal(static_cast<size_t>(r) * N);
  std::vector<uint16_t> b_halves(b_values.size());
  std::vector<float> b(b_values.size());
  for (size_t i = 0; i < b.size(); i++)
    b_halves[i] = to_half(b_values[i]), b[i] = from_half(b_halves[i]);
  std::vector<int> columns(r);
  for (int j = 0; j < r; j++) columns[j] = j;
  std::vector<std::vector<float>> start(rows), out(rows), out_halves(rows);
  const float* hs_read[hotlora::kLoraRows];
  float *outs[hotlora::kLoraRows], *outs_halves[hotlora::kLoraRows];
  for (int g = 0; g < rows; g++) {
    start[g] = normal(N), out[g] = start[g], out_halves[g] = start[g];
    hs_read[g] = h[g].data(), outs[g] = out[g].data(), outs_halves[g] = out_halves[g].data();
  }
  kernel.residuals(hs_read, b.data(), N, columns.data(), r, outs, rows, n0, N);
  kernel.residuals_half(hs_read, b_halves.data(), N, columns.data(), r, outs_halves, rows, n0, N);
  for (int g = 0; g < rows; g++)
    for (int n = 0; n < N; n++) {
      float want = start[g][n];
      if (n >= n0)
        for (int j = 0; j < r; j++)
          want = std::fma(h[g][j], b[static_cast<size_t>(j) * N + n], want);
      if (std::memcmp(&out[g][n], &want, sizeof(float)) != 0)
        fail(kernel.isa, "residuals", rows, r, N, g, n, out[g][n], want);
      if (std::memcmp(&out_halves[g][n], &want, sizeof(float)) != 0)
        fail(kernel.isa, "residuals of float16", rows, r, N, g, n, out_halves[g][n], want);
    }
}

}  // namespace

int main() {
  int isas = 0;
  for (const Kernel* entry : hotlora::kernels()) {
    const Kernel& kernel = *entry;
    if (!kernel.supported()) {
      std::printf("%s: not run, the CPU lacks it\n", kernel.isa);
      continue;
    }
    int checks = 0;
    // Widths off every vector (7, 100), short rows and long ones (past every ISA's kShortK).
    for (int M : {1, 3, 16, 40})
      for (int K : {7, 100, 576, 4100})
        for (int R : {0, 5}) check_float(kernel, M, K, 37, R), checks++;
    // Rows in registers (up to 8) and against tiles; K of several groups, N off the blocks.
    for (int M : {1, 3, 16, 40})
      for (int bits : {4, 8})
        for (int group : {32, 64, 128})
          for (int dtype : {0, 1, 2})
            for (int R : {0, 6}) check_quant(kernel, M, 384, 37, bits, group, dtype, R), checks++;
    // The integer products: rows of x in the kernel's blocks and alone, K of several groups;
    // weight rows in eights (the interleaved layout's too, where the kernel has it) or not; a
    // value one int8 code or three parts.
    for (int M : {1, 3, 9})
      for (int bits : {4, 8})
        for (int group : {32, 64, 128})
          for (int dtype : {0, 1, 2})
            for (int N : {37, 40})
              for (int parts : {1, 3})
                check_int8(kernel, M, 384, N, bits, group, dtype, parts), checks++;
    // 8-bit codes under 32 and 64 (5- and 6-bit ones widened) where the interleaved layout also
    // takes them at 5 and 6 bits.
    for (int M : {1, 3, 9})
      for (int levels : {32, 64})
        for (int group : {32, 64, 128})
          for (int dtype : {0, 1, 2})
            for (int parts : {1, 3})
              if (kernel.int8_rows8 != nullptr)
                check_int8(kernel, M, 384, 40, 8, group, dtype, parts, levels), checks++;
    // An adapter's ranks below, at and past each ISA's vector (4, 8 or 16 lanes), for one row
    // to kLoraRows rows of it in one call.
    for (int K : {7, 100, 576})
      for (int r = 1; r <= 40; r++)
        for (int rows = 1; rows <= hotlora::kLoraRows; rows++)
          check_low_rank(kernel, K, r, rows), checks++;
    // Query heads a KV head serves (up to 4 at once, then the rest), head sizes off the vectors.
    for (int G : {1, 3, 7})
      for (int D : {64, 7})
        for (int S : {1, 13, 300})
          for (int shown : {2, 1, 0}) check_attention(kernel, G, D, S, shown), checks++;
    // Left padding of every size up to two vectors, on positions off the vectors' lanes.
    for (int pad = 1; pad <= 33; pad++)
      for (int S : {13, 100}) check_attention_padding(kernel, 3, 64, S, pad), checks++;
    // A prompt chunk's tokens together: each head count's tiles of tokens, then what is left;
    // several tiles over several blocks of keys (kKeyBlock).
    for (int T : {2, 3, 4, 7, 26})
      for (int G : {1, 2, 3, 4, 5})
        for (int S : {9, 300})
          for (bool blind : {false, true})
            check_attention_tokens(kernel, T, G, 64, S, blind), checks++;
    std::printf(
        "%s: %d products (integer ones included), low-rank activations and attentions right, "
        "each row's product the same bits alone and in its batch\n",
        kernel.isa, checks);
    isas++;
  }
  return isas > 0 ? 0 : 1;
}
