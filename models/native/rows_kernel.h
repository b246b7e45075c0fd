// The kernel of rows_matmul.cpp, written once for every vector ISA: included inside a namespace
// that defines `Isa` (vector type and operations, register blocking), under that ISA's target.
// No include guard: each inclusion is another ISA.

// out[m, r] = x[m, :] . w[r, :] for m < P, r < R.
template <int P, int R, bool kPrefetchW>
inline void block(const float* x, const float* w, float* out, int K, int ldo) {
  typename Isa::V acc[R][P];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) acc[r][m] = Isa::zero();
  const int full = K - K % Isa::kLanes;
  int k = 0;
  for (; k < full; k += Isa::kLanes) {
    typename Isa::V u[R];
    for (int r = 0; r < R; r++) {
      const float* row = w + static_cast<size_t>(r) * K + k;
      u[r] = Isa::load(row);
      if (kPrefetchW) _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T0);
    }
    for (int m = 0; m < P; m++) {
      const typename Isa::V xv = Isa::load(x + static_cast<size_t>(m) * K + k);
      for (int r = 0; r < R; r++) acc[r][m] = Isa::fma(u[r], xv, acc[r][m]);
    }
  }
  if (k < K) {  // the last K % kLanes columns, the lanes beyond them zero
    typename Isa::V u[R];
    for (int r = 0; r < R; r++) u[r] = Isa::load_first(w + static_cast<size_t>(r) * K + k, K - k);
    for (int m = 0; m < P; m++) {
      const typename Isa::V xv = Isa::load_first(x + static_cast<size_t>(m) * K + k, K - k);
      for (int r = 0; r < R; r++) acc[r][m] = Isa::fma(u[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) out[static_cast<size_t>(m) * ldo + r] = Isa::sum(acc[r][m]);
}

// The last `rows` (< P) rows of x against R weight rows.
template <int P, int R>
inline void last_rows(int rows, const float* x, const float* w, float* out, int K, int ldo) {
  if constexpr (P > 1) {
    if (rows == P - 1)
      block<P - 1, R, false>(x, w, out, K, ldo);
    else
      last_rows<P - 1, R>(rows, x, w, out, K, ldo);
  }
}

// Rows [0, M) of x against weight rows [0, R): passes of P rows, the first one prefetching.
template <int P, int R>
void rows_against(const float* x, const float* w, float* out, int M, int K, int ldo) {
  int m = 0;
  for (; m + P <= M; m += P) {
    const float* xs = x + static_cast<size_t>(m) * K;
    float* os = out + static_cast<size_t>(m) * ldo;
    if (m == 0)
      block<P, R, true>(xs, w, os, K, ldo);
    else
      block<P, R, false>(xs, w, os, K, ldo);
  }
  if (m < M)
    last_rows<P, R>(M - m, x + static_cast<size_t>(m) * K, w, out + static_cast<size_t>(m) * ldo, K, ldo);
}

// Weight rows [n0, n1) against every row of x, R at a time; the passes over x stay in L1
// beside the weight block (P rows for short rows, fewer for long ones).
template <int P, int R>
void weight_rows(const float* x, const float* w, float* out, int M, int N, int K, int n0, int n1) {
  int n = n0;
  for (; n + R <= n1; n += R)
    rows_against<P, R>(x, w + static_cast<size_t>(n) * K, out + n, M, K, N);
  for (; n < n1; n++) rows_against<P, 1>(x, w + static_cast<size_t>(n) * K, out + n, M, K, N);
}

void rows_matmul_range(const float* x, const float* w, float* out, int M, int N, int K, int n0, int n1) {
  if (K <= Isa::kShortK)
    weight_rows<Isa::kShortP, Isa::kShortR>(x, w, out, M, N, K, n0, n1);
  else
    weight_rows<Isa::kLongP, Isa::kLongR>(x, w, out, M, N, K, n0, n1);
}
