// The low-rank half of rows_matmul.cpp's gathered LoRA (QuantMatmulGather), written once for
// every vector ISA: included after rows_kernel.h inside a namespace that defines `Isa`, under
// that ISA's target. No include guard: each inclusion is another ISA.

// h[j] = scale * (x . a[:, j]) for j < r, one row x [K] against an adapter's A as mounted,
// a [K, r] row-major (mlx-lm's lora_a), float32 or float16 (quant_kernel.h's load_floats): the rank runs along the vector lanes, so A is read
// once, row by row. Each sum is four chains of fused multiply-adds over k = u, u + 4, ...
// (u < 4), added as (c0 + c1) + (c2 + c3), then scaled: a fixed order over K. Every lane, those of
// the last, partly filled vector too, does the same operations, so h depends neither on the
// vector width nor on the other rows or adapters of the call.
// The first n < kLanes values from p as floats, then zeros.
inline typename Isa::V load_first_floats(const float* p, int n) { return Isa::load_first(p, n); }
inline typename Isa::V load_first_floats(const uint16_t* p, int n) {
  uint16_t lanes[Isa::kLanes] = {};
  std::memcpy(lanes, p, sizeof(uint16_t) * n);
  return Isa::load_half(lanes);
}

// The n < kLanes values at a + offset as the first lanes: a whole vector's load where it stays
// inside the array (size values), the lanes past n holding what follows, never stored; else the
// n values alone. The first lanes' operations are the same either way.
template <typename T>
inline typename Isa::V load_tail(const T* a, size_t offset, size_t size, int n) {
  return offset + Isa::kLanes <= size ? load_floats(a + offset) : load_first_floats(a + offset, n);
}

template <typename T>
void low_rank_row(const float* x, const T* a, int K, int r, float scale, float* h) {
  using V = typename Isa::V;
  int j = 0;
  for (; j + Isa::kLanes <= r; j += Isa::kLanes) {
    V c[4] = {Isa::zero(), Isa::zero(), Isa::zero(), Isa::zero()};
    int k = 0;
    for (; k + 4 <= K; k += 4)
      for (int u = 0; u < 4; u++)
        c[u] = Isa::fma(Isa::set1(x[k + u]), load_floats(a + static_cast<size_t>(k + u) * r + j),
                        c[u]);
    for (; k < K; k++)
      c[k % 4] = Isa::fma(Isa::set1(x[k]), load_floats(a + static_cast<size_t>(k) * r + j),
                          c[k % 4]);
    const V sum = Isa::add(Isa::add(c[0], c[1]), Isa::add(c[2], c[3]));
    Isa::store(h + j, Isa::mul(sum, Isa::set1(scale)));
  }
  if (j < r) {  // the last r - j columns: the same operations, on the first lanes of a vector
    const int n = r - j;
    const size_t size = static_cast<size_t>(K) * r;
    V c[4] = {Isa::zero(), Isa::zero(), Isa::zero(), Isa::zero()};
    int k = 0;
    for (; k + 4 <= K; k += 4)
      for (int u = 0; u < 4; u++)
        c[u] = Isa::fma(Isa::set1(x[k + u]),
                        load_tail(a, static_cast<size_t>(k + u) * r + j, size, n), c[u]);
    for (; k < K; k++)
      c[k % 4] = Isa::fma(Isa::set1(x[k]), load_tail(a, static_cast<size_t>(k) * r + j, size, n),
                          c[k % 4]);
    const V sum = Isa::add(Isa::add(c[0], c[1]), Isa::add(c[2], c[3]));
    float lanes[Isa::kLanes];
    Isa::store(lanes, Isa::mul(sum, Isa::set1(scale)));
    std::memcpy(h + j, lanes, sizeof(float) * n);
  }
}
