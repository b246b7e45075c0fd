// The elementwise functions of the kernels, written once for every ISA: included inside an ISA's
// namespace, under its target, so that its loops vectorize for it and its fused multiply-adds are
// instructions; each inclusion is another ISA, so no include guard. Each value's operations are
// its own and one rounding each, as MLX's CPU kernels take them, so any number of values at once,
// in any vector width, give MLX's bits.

// MLX's exp on the CPU (`mlx/backend/cpu/simd/math.h`): 2^(x log2 e), the fraction by a
// polynomial, the integer part in the exponent bits. A copy rather than MLX's header function:
// built here under the ISA's target, its fused multiply-adds are instructions, where the
// header's, built for baseline x86-64 as the RoPE needs them, are libm calls (the attention
// took twice as long with them).
inline float exp_poly(float in) {
  const float clamped = std::clamp(in, -100.0f, 100.0f);  // the integer part stays an int
  const float x2 = clamped * 1.442695f;
  // MLX adds the double 0.5 (its scalar arithmetic promotes): a float sum rounds differently.
  const float ipart = static_cast<float>(std::floor(static_cast<double>(x2) + 0.5));
  const float fpart = x2 - ipart;
  float x = 1.535336188319500e-4f;
  x = std::fma(x, fpart, 1.339887440266574e-3f);
  x = std::fma(x, fpart, 9.618437357674640e-3f);
  x = std::fma(x, fpart, 5.550332471162809e-2f);
  x = std::fma(x, fpart, 2.402264791363012e-1f);
  x = std::fma(x, fpart, 6.931472028550421e-1f);
  x = std::fma(x, fpart, 1.000000000000000f);
  const int32_t bits = (static_cast<int32_t>(ipart) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof power);
  // Selects, not branches: a loop of these vectorizes (with -fno-trapping-math).
  const float value = power * x;
  const float low = in < -88.0f ? 0.0f : value;
  const float high = in > 88.0f ? std::numeric_limits<float>::infinity() : low;
  return std::isnan(in) ? in : high;
}

// mlx_lm's swiglu of n values, SiLU(gate) * up, to MLX's bits (a `Glu`): MLX's Sigmoid (1 / (1 +
// exp(|x|)), then 1 - that for x >= 0), gate times it, times up, one rounding an operation.
// tests/unit/test_packed_kernels.py holds the products' activation to mlx_lm's own.
inline void swiglu_rows(const float* gate, const float* up, float* out, int n) {
  for (int i = 0; i < n; i++) {
    const float g = gate[i];
    const float y = 1.0f / (1.0f + exp_poly(std::fabs(g)));
    const float sigmoid = g < 0.0f ? y : 1.0f - y;
    out[i] = (g * sigmoid) * up[i];
  }
}
