// The adapter checks: all_finite and to_half.
#include "adapter_checks.h"

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <utility>

#include "mlx/allocator.h"
#include "mlx/types/half_types.h"

namespace hotlora {
namespace {

// Whether none of the n values has every bit of `exponent` set (a NaN or an infinity).
template <typename Bits>
bool finite_bits(const Bits* p, size_t n, Bits exponent) {
  Bits seen = 0;  // a lane's exponent bits where every one of them was set: none, if finite
  for (size_t i = 0; i < n; i++) seen |= static_cast<Bits>(~p[i] & exponent) == 0 ? 1 : 0;
  return seen == 0;
}

}  // namespace

std::vector<bool> all_finite(const std::vector<mx::array>& arrays) {
  std::vector<bool> out;
  out.reserve(arrays.size());
  for (auto a : arrays) {
    a.eval();
    if (!a.flags().row_contiguous)
      throw std::invalid_argument("all_finite: the arrays must be row-contiguous");
    const size_t n = a.size();
    if (a.dtype() == mx::float32)
      out.push_back(finite_bits<uint32_t>(a.data<uint32_t>(), n, 0x7f800000u));
    else if (a.dtype() == mx::float16)
      out.push_back(finite_bits<uint16_t>(a.data<uint16_t>(), n, 0x7c00u));
    else if (a.dtype() == mx::bfloat16)
      out.push_back(finite_bits<uint16_t>(a.data<uint16_t>(), n, 0x7f80u));
    else
      throw std::invalid_argument("all_finite: float32, float16 or bfloat16 arrays only");
  }
  return out;
}

std::tuple<std::vector<mx::array>, std::vector<bool>> to_half(
    const std::vector<mx::array>& arrays) {
  std::vector<mx::array> out;
  std::vector<bool> finite;
  out.reserve(arrays.size());
  finite.reserve(arrays.size());
  for (auto a : arrays) {
    a.eval();
    if (a.dtype() != mx::float32) throw std::invalid_argument("to_half: float32 arrays only");
    const bool flat = a.flags().row_contiguous;
    if (!flat && a.ndim() != 2)
      throw std::invalid_argument("to_half: the arrays must be row-contiguous or 2-D");
    mx::array half(mx::allocator::malloc(a.size() * sizeof(uint16_t)), a.shape(), mx::float16);
    uint16_t* h = half.data<uint16_t>();
    const float* x = a.data<float>();
    auto round = [h](size_t i, float value) { h[i] = mx::float16_t(value).bits_; };
    if (flat) {
      for (size_t i = 0; i < a.size(); i++) round(i, x[i]);
    } else {
      const int rows = a.shape(0), cols = a.shape(1);
      const int64_t s0 = a.strides()[0], s1 = a.strides()[1];
      for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) round(static_cast<size_t>(i) * cols + j, x[i * s0 + j * s1]);
    }
    finite.push_back(finite_bits<uint16_t>(h, a.size(), 0x7c00u));
    out.push_back(std::move(half));
  }
  return {std::move(out), std::move(finite)};
}

}  // namespace hotlora
