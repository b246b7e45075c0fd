// The kernel of rows_matmul.cpp, written once for every vector ISA: included inside a namespace
// that defines `Isa` (vector type and operations, register blocking), under that ISA's target.
// No include guard: each inclusion is another ISA.

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
#if defined(__x86_64__)
      if (kPrefetchW) _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T0);
#else
      if (kPrefetchW) __builtin_prefetch(row + kPrefetch);
#endif
    }
    for (int m = 0; m < P; m++) {
      const typename Isa::V xv = Isa::load(seg.x + static_cast<size_t>(m) * K + k);
      for (int r = 0; r < R; r++) acc[r][m] = Isa::fma(u[r], xv, acc[r][m]);
    }
  }
  if (k < K) {  // the last K % kLanes columns, the lanes beyond them zero
    typename Isa::V u[R];
    for (int r = 0; r < R; r++) u[r] = Isa::load_first(seg.w + static_cast<size_t>(r) * K + k, K - k);
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
    last_rows<P, R>(
        M - m, main.rows(m, 0), extra.rows(m, 0), out + static_cast<size_t>(m) * ldo, ldo);
}

// Weight rows [n0, n1) against every row of x, R at a time; the passes over x stay in L1
// beside the weight block (P rows for short rows, fewer for long ones).
template <int P, int R>
void weight_rows(const Seg& main, const Seg& extra, float* out, int M, int N, int n0, int n1) {
  int n = n0;
  for (; n + R <= n1; n += R) rows_against<P, R>(main.rows(0, n), extra.rows(0, n), out + n, M, N);
  for (; n < n1; n++) rows_against<P, 1>(main.rows(0, n), extra.rows(0, n), out + n, M, N);
}

// out[:, n0:n1] of main.x @ main.w.T (+ extra.x @ extra.w.T); out is [M, N].
void rows_matmul_range(const Seg& main, const Seg& extra, float* out, int M, int N, int n0, int n1) {
  if (main.k <= Isa::kShortK)
    weight_rows<Isa::kShortP, Isa::kShortR>(main, extra, out, M, N, n0, n1);
  else
    weight_rows<Isa::kLongP, Isa::kLongR>(main, extra, out, M, N, n0, n1);
}

// The attention of one query token, for the G query heads of one row that share a KV head
// (`attend`, below). Scores of the keys a row does not see are the lowest float, as MLX's
// `where(mask, scores, lowest)` makes them; their probabilities are then exactly zero.
constexpr float kLowest = -std::numeric_limits<float>::max();

// scores[g, s] = q[g] . k[s] for the GN query heads of q [GN, D] and the visible keys.
template <int GN>
inline void group_scores(const float* q, int D, const float* k, int64_t k_step,
                         const bool* visible, int64_t visible_step, int S, float* scores) {
  const int full = D - D % Isa::kLanes;
  for (int s = 0; s < S; s++) {
    if (!visible[s * visible_step]) {
      for (int g = 0; g < GN; g++) scores[static_cast<size_t>(g) * S + s] = kLowest;
      continue;
    }
    const float* ks = k + s * k_step;
    typename Isa::V acc[GN];
    for (int g = 0; g < GN; g++) acc[g] = Isa::zero();
    int d = 0;
    for (; d < full; d += Isa::kLanes) {
      const typename Isa::V kv = Isa::load(ks + d);
      for (int g = 0; g < GN; g++) acc[g] = Isa::fma(Isa::load(q + g * D + d), kv, acc[g]);
    }
    if (d < D) {
      const typename Isa::V kv = Isa::load_first(ks + d, D - d);
      for (int g = 0; g < GN; g++)
        acc[g] = Isa::fma(Isa::load_first(q + g * D + d, D - d), kv, acc[g]);
    }
    for (int g = 0; g < GN; g++) scores[static_cast<size_t>(g) * S + s] = Isa::sum(acc[g]);
  }
}

// out[g] = sum over the visible s of p[g, s] * v[s], for GN rows of probabilities p [GN, S].
template <int GN>
inline void group_values(const float* p, int S, const float* v, int64_t v_step, int Dv,
                         const bool* visible, int64_t visible_step, float* out) {
  for (int d = 0; d < Dv; d += Isa::kLanes) {
    const int n = std::min(Isa::kLanes, Dv - d);
    typename Isa::V acc[GN];
    for (int g = 0; g < GN; g++) acc[g] = Isa::zero();
    for (int s = 0; s < S; s++) {
      if (!visible[s * visible_step]) continue;
      const float* vs = v + s * v_step + d;
      const typename Isa::V vv = n == Isa::kLanes ? Isa::load(vs) : Isa::load_first(vs, n);
      for (int g = 0; g < GN; g++)
        acc[g] = Isa::fma(Isa::set1(p[static_cast<size_t>(g) * S + s]), vv, acc[g]);
    }
    for (int g = 0; g < GN; g++) {
      float lanes[Isa::kLanes];
      Isa::store(lanes, acc[g]);
      std::copy(lanes, lanes + n, out + static_cast<size_t>(g) * Dv + d);
    }
  }
}

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

// Each row of scores [G, S] replaced by its softmax: exp(s - max) * (1 / sum), as MLX's precise
// float32 softmax computes it.
inline void softmax_rows(float* scores, int G, int S) {
  for (int g = 0; g < G; g++) {
    float* row = scores + static_cast<size_t>(g) * S;
    float top = kLowest;
    for (int s = 0; s < S; s++) top = std::max(top, row[s]);
    // The exponentials apart from the sum, a loop the compiler vectorizes; the sum stays one
    // running float, in MLX's order.
    for (int s = 0; s < S; s++) row[s] = exp_poly(row[s] - top);
    float total = 0.0f;
    for (int s = 0; s < S; s++) total += row[s];
    const float inv = 1.0f / total;
    for (int s = 0; s < S; s++) row[s] *= inv;
  }
}

// part(g0, GN) over the G query heads, GN of them (up to 4, a compile-time constant) at a time.
template <typename Part>
inline void by_heads(int G, Part part) {
  for (int g0 = 0; g0 < G; g0 += 4) {
    switch (std::min(4, G - g0)) {
      case 1: part(g0, std::integral_constant<int, 1>{}); break;
      case 2: part(g0, std::integral_constant<int, 2>{}); break;
      case 3: part(g0, std::integral_constant<int, 3>{}); break;
      default: part(g0, std::integral_constant<int, 4>{}); break;
    }
  }
}

// out [G, Dv] = p [G, S] . v over the visible positions.
inline void weigh_values(const float* p, int G, int S, const float* v, int64_t v_step, int Dv,
                         const bool* visible, int64_t visible_step, float* out) {
  by_heads(G, [&](int g0, auto heads) {
    group_values<decltype(heads)::value>(p + static_cast<size_t>(g0) * S, S, v, v_step, Dv,
                                         visible, visible_step, out + static_cast<size_t>(g0) * Dv);
  });
}

// out [G, Dv] = softmax(q [G, D] . k^T over the visible keys) . v: the G query heads of one
// row that share a KV head, q already scaled; keys and values are S rows `k_step` and `v_step`
// floats apart, the mask S flags `visible_step` apart. scores: G * S floats of scratch.
// A hidden position weighs exactly zero and its value is not read (a NaN there stays out, where
// MLX's 0 * NaN would spread it). A row that sees no key at all weighs every position alike, as
// MLX's softmax over scores that are all the lowest float does.
void attend(const float* q, int G, int D, const float* k, int64_t k_step, const float* v,
            int64_t v_step, int Dv, const bool* visible, int64_t visible_step, int S,
            float* scores, float* out) {
  bool any = false;
  for (int s = 0; s < S && !any; s++) any = visible[s * visible_step];
  if (!any) {
    static const bool kEvery = true;
    std::fill(scores, scores + static_cast<size_t>(G) * S, kLowest);
    softmax_rows(scores, G, S);
    weigh_values(scores, G, S, v, v_step, Dv, &kEvery, 0, out);
    return;
  }
  by_heads(G, [&](int g0, auto heads) {
    group_scores<decltype(heads)::value>(q + static_cast<size_t>(g0) * D, D, k, k_step, visible,
                                         visible_step, S, scores + static_cast<size_t>(g0) * S);
  });
  softmax_rows(scores, G, S);
  weigh_values(scores, G, S, v, v_step, Dv, visible, visible_step, out);
}
