// The packed weights the quantized kernels take, one entry a code width: MLX's affine mode,
// value q of `bits` bits dequantized to scale * q + bias, a scale and a bias a group of values.
// A width listed here is instantiated by every ISA's quantized kernels (kernels/quant_matmul.h)
// and accepted by the primitives (primitives/quant_matmul.cpp); each ISA's traits unpack its
// codes (`Isa::codes32<Bits>`, kernels/isa/*.h). README.md has the whole recipe.
#pragma once

#include <array>
#include <iterator>
#include <string>
#include <type_traits>

namespace hotlora {

template <int... Bits>
struct QuantBitsList {};

// The code widths served: 4 bits (two values a byte) and 8 (one a byte).
using QuantTypes = QuantBitsList<4, 8>;

// The group sizes served: each a multiple of 32, the values a kernel unpacks at once.
constexpr int kQuantGroups[] = {32, 64, 128};

// Calls f(std::integral_constant<int, B>{}) for the B of the list equal to `bits`; false if none.
template <typename F, int... B>
constexpr bool with_quant_bits(int bits, F&& f, QuantBitsList<B...>) {
  return ((bits == B ? (f(std::integral_constant<int, B>{}), true) : false) || ...);
}

template <typename F>
constexpr bool with_quant_bits(int bits, F&& f) {
  return with_quant_bits(bits, f, QuantTypes{});
}

constexpr bool quant_bits_served(int bits) {
  return with_quant_bits(bits, [](auto) {});
}

constexpr bool quant_group_served(int group) {
  for (const int served : kQuantGroups)
    if (group == served) return true;
  return false;
}

// "4 or 8", "32, 64 or 128": the served values in words, for error messages.
template <typename Values>
std::string served_words(const Values& values) {
  std::string out;
  const int count = static_cast<int>(std::size(values));
  for (int i = 0; i < count; i++)
    out += (i == 0 ? "" : i + 1 == count ? " or " : ", ") + std::to_string(values[i]);
  return out;
}

template <int... B>
constexpr auto quant_bits_array(QuantBitsList<B...>) {
  return std::array<int, sizeof...(B)>{B...};
}

}  // namespace hotlora
