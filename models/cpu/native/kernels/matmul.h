// `x @ w.T` for float32 rows, written once for every ISA: included inside an ISA's namespace,
// under its target, after its traits (`Isa`, kernels/isa/*.h); each inclusion is another ISA, so
// no include guard. Each output is one dot product summed in a fixed order (`accumulate`), so a
// row's result does not depend on the other rows of the batch.

// acc[r][m] += x[m, :] . w[r, :] over the segment's k columns, for m < P, r < R.
template <int P, int R, bool kPrefetchW>
inline void accumulate(typename Isa::V (&acc)[R][P], const Seg& seg) {
  const int K = seg.k;
  const int full = K - K % Isa::kLanes;
  int k = 0;
  for (; k < full; k += Isa::kLanes) {
    typename Isa::V u[R];
    for (int r = 0; r < R; r++) {
      const float* row = seg.w + static_cast<size_t>(r) * K + k;
      u[r] = Isa::load(row);
      if (kPrefetchW) Isa::prefetch(row + kPrefetch);
    }
    for (int m = 0; m < P; m++) {
      const typename Isa::V xv = Isa::load(seg.x + static_cast<size_t>(m) * K + k);
      for (int r = 0; r < R; r++) acc[r][m] = Isa::fma(u[r], xv, acc[r][m]);
    }
  }
  if (k < K) {  // the last K % kLanes columns, the lanes beyond them zero
    typename Isa::V u[R];
    for (int r = 0; r < R; r++)
      u[r] = Isa::load_first(seg.w + static_cast<size_t>(r) * K + k, K - k);
    for (int m = 0; m < P; m++) {
      const typename Isa::V xv = Isa::load_first(seg.x + static_cast<size_t>(m) * K + k, K - k);
      for (int r = 0; r < R; r++) acc[r][m] = Isa::fma(u[r], xv, acc[r][m]);
    }
  }
}

// out[m, r] = x[m, :] . w[r, :] (+ x2[m, :] . w2[r, :]) for m < P, r < R: one sum per output.
template <int P, int R, bool kPrefetchW>
inline void block(const Seg& main, const Seg& extra, float* out, int ldo) {
  typename Isa::V acc[R][P];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) acc[r][m] = Isa::zero();
  accumulate<P, R, kPrefetchW>(acc, main);
  if (extra.k > 0) accumulate<P, R, false>(acc, extra);
  for (int r = 0; r < R; r++)
    for (int m = 0; m < P; m++) out[static_cast<size_t>(m) * ldo + r] = Isa::sum(acc[r][m]);
}

// The last `rows` (< P) rows of x against R weight rows.
template <int P, int R>
inline void last_rows(int rows, const Seg& main, const Seg& extra, float* out, int ldo) {
  if constexpr (P > 1) {
    if (rows == P - 1)
      block<P - 1, R, false>(main, extra, out, ldo);
    else
      last_rows<P - 1, R>(rows, main, extra, out, ldo);
  }
}

// Rows [0, M) of x against weight rows [0, R): passes of P rows, the first one prefetching.
template <int P, int R>
void rows_against(const Seg& main, const Seg& extra, float* out, int M, int ldo) {
  int m = 0;
  for (; m + P <= M; m += P) {
    float* os = out + static_cast<size_t>(m) * ldo;
    if (m == 0)
      block<P, R, true>(main.rows(m, 0), extra.rows(m, 0), os, ldo);
    else
      block<P, R, false>(main.rows(m, 0), extra.rows(m, 0), os, ldo);
  }
  if (m < M)
    last_rows<P, R>(M - m, main.rows(m, 0), extra.rows(m, 0), out + static_cast<size_t>(m) * ldo,
                    ldo);
}

// Weight rows [n0, n1) against every row of x, R at a time; the passes over x stay in L1
// beside the weight block (P rows for short rows, fewer for long ones).
template <int P, int R>
void weight_rows(const Seg& main, const Seg& extra, float* out, int M, int N, int n0, int n1) {
  int n = n0;
  for (; n + R <= n1; n += R) rows_against<P, R>(main.rows(0, n), extra.rows(0, n), out + n, M, N);
  for (; n < n1; n++) rows_against<P, 1>(main.rows(0, n), extra.rows(0, n), out + n, M, N);
}

// out[:, n0:n1] of main.x @ main.w.T (+ extra.x @ extra.w.T); out is [M, N] (a `Range`).
inline void rows_matmul_range(const Seg& main, const Seg& extra, float* out, int M, int N, int n0,
                              int n1) {
  if (main.k <= Isa::kShortK)
    weight_rows<Isa::kShortP, Isa::kShortR>(main, extra, out, M, N, n0, n1);
  else
    weight_rows<Isa::kLongP, Isa::kLongR>(main, extra, out, M, N, n0, n1);
}
