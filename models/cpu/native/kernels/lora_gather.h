// The gathered LoRA's kernels (Punica's BGMV, lora_plans.h's RowResiduals), written once for
// every ISA: included inside an ISA's namespace, under its target, after its traits (`Isa`,
// kernels/isa/*.h); each inclusion is another ISA, so no include guard. A row's activations of
// one adapter (low_rank_rows), then its residual added to the row's base product (add_residuals),
// each in a fixed order of its own: a row's bits depend neither on the vector width nor on the
// other rows and adapters of the call. Rows that apply the same adapter may share a call, which
// reads its pair once for them all.

// b's values as floats, `Isa::kLanes` of them from p: float32 as they are, float16 converted (an
// exact conversion: the sums that follow are those of the float32 values).
inline typename Isa::V load_floats(const float* p) { return Isa::load(p); }
inline typename Isa::V load_floats(const uint16_t* p) { return Isa::load_half(p); }

// A float32 as it is, a float16's bits as the float it holds.
inline float to_float(float value) { return value; }
inline float to_float(uint16_t half) { return Isa::half_to_float(half); }

// How far ahead of what they read the LoRA's kernels ask for their adapters' values, a cache
// line at a time, where they ask (`lora_asks_ahead`, kernels/types.h): b's rows
// `kResidualsAhead` values ahead along N, a's rows `kLowRankAhead` rows ahead. Each adapter's
// arrays are short streams read once a step (16 rows of 16 adapters on the embedded model: 149 MB
// of float16 a step, from memory), which an Intel Xeon's hardware prefetch does not run ahead
// of: asked for ahead, the adapters took 11.0-11.2 ms on top of a 16-row step in process instead
// of 13.3 (256 and 32, 512 and 64, 1,024 and 128 alike).
constexpr int kResidualsAhead = 256;
constexpr int kLowRankAhead = 32;
constexpr int kLineBytes = 64;

// out[g][n0:n1] += one adapter's low-rank residual for each of G rows of x that apply it (h[g]
// their activations), b [R, N] (float32, or float16 as the packed kernels keep adapters by
// default): for the columns r listed (QuantMatmulGather lists all of an adapter's, in order),
// h[g][r] * b[r, n] added one at a time (a fused multiply-add each). Each of b's vectors is loaded
// (and converted) once for the G rows. Each output is its own sequence of operations: its bits
// depend neither on the vector width, nor on columns not listed, nor on the rows beside it.
// Vectors of outputs a few at a time, chains of multiply-adds in flight (one chain waits on each
// multiply-add's latency; eight at one row), then one at a time. 16 rows of 16 distinct rank-16
// float16 adapters on the embedded model, a Zen 2 EPYC (AVX2), runs alternating the builds: the
// residuals' passes 8.0-8.4 ms a step at eight chains a row against 8.2-8.8 at four, and
// 7.5-7.9 with low_rank_of's two vectors of columns a pass (tried, not kept: b's rows each read
// through with the outputs in L1, 8.0-8.3).
template <int G, typename T>
void add_residuals_of(const float* const* h, const T* b, int N, const int* columns, int count,
                      float* const* out, int n0, int n1) {
  using V = typename Isa::V;
  constexpr int kChains = G == 1 ? 8 : G == 2 ? 4 : 2;
  const bool ask = lora_asks_ahead();
  int n = n0;
  for (; n + kChains * Isa::kLanes <= n1; n += kChains * Isa::kLanes) {
    V acc[G][kChains];
    for (int g = 0; g < G; g++)
      for (int v = 0; v < kChains; v++) acc[g][v] = Isa::load(out[g] + n + v * Isa::kLanes);
    for (int i = 0; i < count; i++) {
      const T* row = b + static_cast<size_t>(columns[i]) * N + n;
      if (ask && n + kChains * Isa::kLanes + kResidualsAhead <= n1)
        for (int at = 0; at < kChains * Isa::kLanes; at += kLineBytes / static_cast<int>(sizeof(T)))
          __builtin_prefetch(row + kResidualsAhead + at);
      V hr[G];
      for (int g = 0; g < G; g++) hr[g] = Isa::set1(h[g][columns[i]]);
      for (int v = 0; v < kChains; v++) {
        const V values = load_floats(row + v * Isa::kLanes);
        for (int g = 0; g < G; g++) acc[g][v] = Isa::fma(hr[g], values, acc[g][v]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int v = 0; v < kChains; v++) Isa::store(out[g] + n + v * Isa::kLanes, acc[g][v]);
  }
  for (; n + Isa::kLanes <= n1; n += Isa::kLanes) {
    V acc[G];
    for (int g = 0; g < G; g++) acc[g] = Isa::load(out[g] + n);
    for (int i = 0; i < count; i++) {
      const int r = columns[i];
      const V values = load_floats(b + static_cast<size_t>(r) * N + n);
      for (int g = 0; g < G; g++) acc[g] = Isa::fma(Isa::set1(h[g][r]), values, acc[g]);
    }
    for (int g = 0; g < G; g++) Isa::store(out[g] + n, acc[g]);
  }
  for (; n < n1; n++)
    for (int g = 0; g < G; g++) {
      float acc = out[g][n];
      for (int i = 0; i < count; i++)
        acc = std::fma(h[g][columns[i]], to_float(b[static_cast<size_t>(columns[i]) * N + n]), acc);
      out[g][n] = acc;
    }
}

// add_residuals_of for `rows` rows of one adapter (kLoraRows, kernels/types.h, a call), four at
// a time.
template <typename T>
void add_residuals(const float* const* h, const T* b, int N, const int* columns, int count,
                   float* const* out, int rows, int n0, int n1) {
  for (int g = 0; g < rows; g += 4) {
    const int n = std::min(rows - g, 4);
    if (n == 1)
      add_residuals_of<1>(h + g, b, N, columns, count, out + g, n0, n1);
    else if (n == 2)
      add_residuals_of<2>(h + g, b, N, columns, count, out + g, n0, n1);
    else if (n == 3)
      add_residuals_of<3>(h + g, b, N, columns, count, out + g, n0, n1);
    else
      add_residuals_of<4>(h + g, b, N, columns, count, out + g, n0, n1);
  }
}

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

// low_rank_of's columns [j, j + J * kLanes) of G rows, in one pass over a; with `Tail` (J 1),
// the last n < kLanes columns [j, j + n): the same operations on the first lanes of a vector
// (load_tail), only those stored.
template <int G, int J, bool Tail = false, typename T>
void low_rank_columns(const float* const* x, const T* a, int K, int r, const float* scale,
                      float* const* h, int j, int n = Isa::kLanes) {
  using V = typename Isa::V;
  const bool ask = lora_asks_ahead() && j == 0;  // the rows' every column, on the first pass
  const size_t size = static_cast<size_t>(K) * r;
  const auto load = [&](int k, int v) {
    const size_t at = static_cast<size_t>(k) * r + j + v * Isa::kLanes;
    if constexpr (Tail) return load_tail(a, at, size, n);
    return load_floats(a + at);
  };
  V c[G][J][4];
  for (int g = 0; g < G; g++)
    for (int v = 0; v < J; v++)
      for (int u = 0; u < 4; u++) c[g][v][u] = Isa::zero();
  int k = 0;
  for (; k + 4 <= K; k += 4) {
    if (ask && k + 4 + kLowRankAhead <= K)
      for (int at = 0; at < 4 * r; at += kLineBytes / static_cast<int>(sizeof(T)))
        __builtin_prefetch(a + static_cast<size_t>(k + kLowRankAhead) * r + at);
    for (int u = 0; u < 4; u++)
      for (int v = 0; v < J; v++) {
        const V values = load(k + u, v);
        for (int g = 0; g < G; g++)
          c[g][v][u] = Isa::fma(Isa::set1(x[g][k + u]), values, c[g][v][u]);
      }
  }
  for (; k < K; k++)
    for (int v = 0; v < J; v++) {
      const V values = load(k, v);
      for (int g = 0; g < G; g++)
        c[g][v][k % 4] = Isa::fma(Isa::set1(x[g][k]), values, c[g][v][k % 4]);
    }
  for (int g = 0; g < G; g++)
    for (int v = 0; v < J; v++) {
      const V sum = Isa::add(Isa::add(c[g][v][0], c[g][v][1]), Isa::add(c[g][v][2], c[g][v][3]));
      const V scaled = Isa::mul(sum, Isa::set1(scale[g]));
      if constexpr (!Tail) {
        Isa::store(h[g] + j + v * Isa::kLanes, scaled);
      } else {
        float lanes[Isa::kLanes];
        Isa::store(lanes, scaled);
        std::memcpy(h[g] + j, lanes, sizeof(float) * n);
      }
    }
}

// h[g][j] = scale[g] * (x[g] . a[:, j]) for j < r, G rows x[g] [K] against an adapter's A as
// mounted, a [K, r] row-major (mlx-lm's lora_a), float32 or float16 (load_floats): the rank runs
// along the vector lanes, so A is read once, row by row, each of its vectors loaded (and
// converted) once for the G rows; one row takes two vectors of columns a pass (eight chains in
// flight). Each sum is four chains of fused multiply-adds over k = u, u + 4, ... (u < 4), added
// as (c0 + c1) + (c2 + c3), then scaled: a fixed order over K. Every lane, those of the last,
// partly filled vector too, does the same operations, so h depends neither on the vector width
// nor on the other rows or adapters of the call.
template <int G, typename T>
void low_rank_of(const float* const* x, const T* a, int K, int r, const float* scale,
                 float* const* h) {
  int j = 0;
  if constexpr (G == 1)
    for (; j + 2 * Isa::kLanes <= r; j += 2 * Isa::kLanes)
      low_rank_columns<1, 2>(x, a, K, r, scale, h, j);
  for (; j + Isa::kLanes <= r; j += Isa::kLanes) low_rank_columns<G, 1>(x, a, K, r, scale, h, j);
  if (j < r) low_rank_columns<G, 1, true>(x, a, K, r, scale, h, j, r - j);  // the last r - j
}

// low_rank_of for `rows` rows (1 to kLoraRows) of one adapter, kLowRankRows at a time: each
// row's four chains stay in registers (two rows' on AVX2's 16 vector registers, four on
// AVX-512's 32).
template <typename T>
void low_rank_rows(const float* const* x, const T* a, int K, int r, const float* scale,
                   float* const* h, int rows) {
  constexpr int kLowRankRows = sizeof(typename Isa::V) >= 64 ? 4 : 2;
  int g = 0;
  for (; g + kLowRankRows <= rows; g += kLowRankRows)
    low_rank_of<kLowRankRows>(x + g, a, K, r, scale + g, h + g);
  for (; g + 2 <= rows; g += 2) low_rank_of<2>(x + g, a, K, r, scale + g, h + g);
  for (; g < rows; g++) low_rank_of<1>(x + g, a, K, r, scale + g, h + g);
}
