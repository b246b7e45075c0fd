// The attention of a row's query tokens and the softmax of scores, written once for every ISA:
// included inside an ISA's namespace, under its target, after its traits (`Isa`,
// kernels/isa/*.h) and kernels/activations.h (`exp_poly`); each inclusion is another ISA, so no
// include guard. Each score, sum and weighted value is taken in a fixed order, so a row's result
// does not depend on the others.

// The attention of a row's query tokens, for the G query heads that share a KV head
// (`attend`, below). Scores of the keys a row does not see are the lowest float, as MLX's
// `where(mask, scores, lowest)` makes them; their probabilities are then exactly zero.
constexpr float kLowest = -std::numeric_limits<float>::max();

// The query tokens a tile of GN heads takes together: TN * GN accumulators, at most 12 (AVX2
// has 16 vector registers).
template <int GN>
constexpr int kTileTokens = GN == 4 ? 3 : 4;

// The accumulators a block of `attend`'s scores or weighted values keeps in registers: up to
// half the ISA's vector registers (a tile's TN * GN at least, up to 12), the rest for what they
// read. Each accumulator is one output's chain of multiply-adds, which waits on the one before; a
// block takes several outputs' chains at once so that one chain's latency does not hold the core.
constexpr int kAttendAccumulators = Isa::kRegisters / 2;
// How many positions ahead of the keys and values being read a block asks for theirs, a cache
// line at a time: a row's keys (then values) are S rows read in order, in pieces too short for
// the hardware's prefetch to run ahead. A decode step of 16 rows at 256 cached positions, 3 query
// heads a KV head, 30 layers, on the AVX-512 machine: 14.2 ms one chain a query head at a time,
// 13.2 in blocks, 8.7 in blocks asking 8 positions ahead (9.9 at 4, 10.9 at 16); at 64
// positions, 2.5, 2.1 and 2.1 ms.
constexpr int kAttendAhead = 8;
constexpr int kFloatsALine = 16;
// The keys whose scores a block of TN tokens of GN heads takes at once, and the vectors of
// values (kLanes each) a block of weighted values does, each vector an accumulator for each
// token and head and one more register for the values read.
template <int GN, int TN>
constexpr int kScoreKeys = std::clamp(kAttendAccumulators / (GN * TN), 1, 4);
template <int GN, int TN>
constexpr int kValueVectors = std::clamp(kAttendAccumulators / (GN * TN + 1), 1, 8);

// scores[t, g, s] = q[t, g] . k[s] for TN tokens of GN query heads, q [TN, G, D] from the tile's
// first head (tokens `q_token` floats apart), scores `s_token` floats a token apart and `s_head`
// a head apart (S keys here, of a row of at least S: `attend` takes a row's keys in blocks); token
// t's mask flags start `token_step` after token t - 1's. Each key is read once for the tile, its
// score not kept where no token of it sees the key; each score is a sum over D in one order,
// whatever the tile and however many keys are taken at once (the same bits for a token alone,
// TN = 1, and beside others).
template <int GN, int TN>
inline void group_scores(const float* q, int64_t q_token, int D, const float* k, int64_t k_step,
                         const bool* visible, int64_t visible_step, int64_t token_step, int S,
                         float* scores, int64_t s_token, int64_t s_head, bool every) {
  using V = typename Isa::V;
  const int full = D - D % Isa::kLanes;
  // The scores' vectors of lanes, summed sixteen at a time (Isa::sums16: Isa::sum's bits, its
  // additions in whole vectors) where each alone took a reduction of its own.
  V pending[16];
  float* into[16];
  int count = 0;
  const auto flush = [&] {
    for (int i = count; i < 16; i++) pending[i] = Isa::zero();
    float sums[16];
    Isa::sums16(pending, sums);
    for (int i = 0; i < count; i++) *into[i] = sums[i];
    count = 0;
  };
  // acc[b][t][g]: key s + b's products with the tile's queries, summed over D in vector lanes
  // (b < KB), their lanes not yet added.
  const auto dots = [&](int s, auto block, auto& acc) {
    constexpr int KB = decltype(block)::value;
    if (s + KB + kAttendAhead <= S)
      for (int b = 0; b < KB; b++)
        for (int at = 0; at < D; at += kFloatsALine)
          __builtin_prefetch(k + (s + b + kAttendAhead) * k_step + at);
    for (int b = 0; b < KB; b++)
      for (int t = 0; t < TN; t++)
        for (int g = 0; g < GN; g++) acc[b][t][g] = Isa::zero();
    int d = 0;
    for (; d < full; d += Isa::kLanes)
      for (int b = 0; b < KB; b++) {
        const V kv = Isa::load(k + (s + b) * k_step + d);
        for (int t = 0; t < TN; t++)
          for (int g = 0; g < GN; g++)
            acc[b][t][g] = Isa::fma(Isa::load(q + t * q_token + g * D + d), kv, acc[b][t][g]);
      }
    if (d < D)
      for (int b = 0; b < KB; b++) {
        const V kv = Isa::load_first(k + (s + b) * k_step + d, D - d);
        for (int t = 0; t < TN; t++)
          for (int g = 0; g < GN; g++)
            acc[b][t][g] =
                Isa::fma(Isa::load_first(q + t * q_token + g * D + d, D - d), kv, acc[b][t][g]);
      }
  };
  // Keys [s, s + KB): each one's sums over D, then its scores in key order.
  const auto keys = [&](int s, auto block, auto all) {
    constexpr int KB = decltype(block)::value;
    constexpr bool All = decltype(all)::value;  // every token sees every key: no flag read
    bool seen[KB][TN], any[KB], some = false;
    for (int b = 0; b < KB; b++) {
      any[b] = false;
      for (int t = 0; t < TN; t++) {
        seen[b][t] = All || visible[t * token_step + (s + b) * visible_step];
        any[b] = any[b] || seen[b][t];
      }
      some = some || any[b];
    }
    if (!some) {
      for (int b = 0; b < KB; b++)
        for (int t = 0; t < TN; t++)
          for (int g = 0; g < GN; g++) scores[t * s_token + g * s_head + s + b] = kLowest;
      return;
    }
    V acc[KB][TN][GN];
    dots(s, block, acc);
    for (int b = 0; b < KB; b++)
      for (int t = 0; t < TN; t++)
        for (int g = 0; g < GN; g++) {
          float* score = scores + t * s_token + g * s_head + s + b;
          if (!seen[b][t]) {
            *score = kLowest;
            continue;
          }
          pending[count] = acc[b][t][g];
          into[count++] = score;
          if (count == 16) flush();
        }
  };
  constexpr int KB = kScoreKeys<GN, TN>;
  int s = 0;
  if (every) {
    // Every score kept: each (token, head)'s 16 keys at a time summed straight into its 16
    // scores (sums16's lanes are the keys), no bookkeeping of where each goes.
    static_assert(16 % KB == 0);
    V sixteen[TN][GN][16];
    for (; s + 16 <= S; s += 16) {
      for (int i = 0; i < 16; i += KB) {
        V acc[KB][TN][GN];
        dots(s + i, std::integral_constant<int, KB>{}, acc);
        for (int b = 0; b < KB; b++)
          for (int t = 0; t < TN; t++)
            for (int g = 0; g < GN; g++) sixteen[t][g][i + b] = acc[b][t][g];
      }
      for (int t = 0; t < TN; t++)
        for (int g = 0; g < GN; g++)
          Isa::sums16(sixteen[t][g], scores + t * s_token + g * s_head + s);
    }
    for (; s < S; s++) keys(s, std::integral_constant<int, 1>{}, std::true_type{});
  } else {
    for (; s + KB <= S; s += KB) keys(s, std::integral_constant<int, KB>{}, std::false_type{});
    for (; s < S; s++) keys(s, std::integral_constant<int, 1>{}, std::false_type{});
  }
  if (count > 0) flush();
}

// out[t, g, d0 : d0 + DC * kLanes] (the last vector's lanes up to Dv) = sum over the positions
// token t sees of p[t, g, s] * v[s, ...], for TN tokens of GN heads (p `p_head` floats a head
// apart): `group_values`' block of DC vectors of values, each position's values read once for
// all of them. `more`: the sums go on from out's (positions before these, `attend`'s blocks), each
// output's chain of multiply-adds the same as over all the positions at once.
template <int GN, int TN, int DC>
inline void values_block(const float* p, int64_t p_token, int64_t p_head, int S, const float* v,
                         int64_t v_step, int Dv, int d0, const bool* visible, int64_t visible_step,
                         int64_t token_step, float* out, int64_t out_token, bool more, bool every) {
  using V = typename Isa::V;
  int lanes[DC];
  // Each of the DC vectors holds one value at least (values_from's blocks end at Dv).
  for (int c = 0; c < DC; c++) lanes[c] = std::clamp(Dv - d0 - c * Isa::kLanes, 1, Isa::kLanes);
  V acc[TN][GN][DC];
  for (int t = 0; t < TN; t++)
    for (int g = 0; g < GN; g++)
      for (int c = 0; c < DC; c++) {
        const float* from =
            out + t * out_token + static_cast<int64_t>(g) * Dv + d0 + c * Isa::kLanes;
        acc[t][g][c] = !more                     ? Isa::zero()
                       : lanes[c] == Isa::kLanes ? Isa::load(from)
                                                 : Isa::load_first(from, lanes[c]);
      }
  // Position s, each token's mask flag read unless every token sees every position (`All`).
  const auto position = [&](int s, auto all) {
    constexpr bool All = decltype(all)::value;
    bool seen[TN], any = All;
    for (int t = 0; t < TN; t++) {
      seen[t] = All || visible[t * token_step + s * visible_step];
      any = any || seen[t];
    }
    if (!any) return;
    const float* vs = v + s * v_step + d0;
    if (s + kAttendAhead < S)
      for (int at = 0; at < DC * Isa::kLanes; at += kFloatsALine)
        __builtin_prefetch(vs + kAttendAhead * v_step + at);
    V vv[DC];
    for (int c = 0; c < DC; c++)
      vv[c] = lanes[c] == Isa::kLanes ? Isa::load(vs + c * Isa::kLanes)
                                      : Isa::load_first(vs + c * Isa::kLanes, lanes[c]);
    for (int t = 0; t < TN; t++) {
      if (!seen[t]) continue;
      for (int g = 0; g < GN; g++) {
        const V weight = Isa::set1(p[t * p_token + g * p_head + s]);
        for (int c = 0; c < DC; c++) acc[t][g][c] = Isa::fma(weight, vv[c], acc[t][g][c]);
      }
    }
  };
  if (every)
    for (int s = 0; s < S; s++) position(s, std::true_type{});
  else
    for (int s = 0; s < S; s++) position(s, std::false_type{});
  for (int t = 0; t < TN; t++)
    for (int g = 0; g < GN; g++)
      for (int c = 0; c < DC; c++) {
        float values[Isa::kLanes];
        Isa::store(values, acc[t][g][c]);
        std::copy(values, values + lanes[c],
                  out + t * out_token + static_cast<int64_t>(g) * Dv + d0 + c * Isa::kLanes);
      }
}

// Vectors [c, vectors) of `group_values`' values, DC at a time, then fewer for the rest.
template <int GN, int TN, int DC, typename... Args>
inline void values_from(int c, int vectors, const float* p, int64_t p_token, int64_t p_head, int S,
                        const float* v, int64_t v_step, int Dv, Args... rest) {
  for (; c + DC <= vectors; c += DC)
    values_block<GN, TN, DC>(p, p_token, p_head, S, v, v_step, Dv, c * Isa::kLanes, rest...);
  if constexpr (DC > 1)
    values_from<GN, TN, DC - 1>(c, vectors, p, p_token, p_head, S, v, v_step, Dv, rest...);
}

// out[t, g] = sum over the positions token t sees of p[t, g, s] * v[s], for TN tokens of GN
// heads, p [TN, G, S] (`p_token` floats a token apart, `p_head` a head apart), out `out_token`
// floats a token apart: each value read once for the tile, not at all where no token of it sees
// the position (a NaN there stays out), each sum over s in one order, whatever the tile and
// however many vectors of values are taken at once; `more` goes on from out's sums.
template <int GN, int TN>
inline void group_values(const float* p, int64_t p_token, int64_t p_head, int S, const float* v,
                         int64_t v_step, int Dv, const bool* visible, int64_t visible_step,
                         int64_t token_step, float* out, int64_t out_token, bool more, bool every) {
  const int vectors = (Dv + Isa::kLanes - 1) / Isa::kLanes;
  values_from<GN, TN, kValueVectors<GN, TN>>(0, vectors, p, p_token, p_head, S, v, v_step, Dv,
                                             visible, visible_step, token_step, out, out_token,
                                             more, every);
}

// Each row of scores [G, S] replaced by its softmax: exp(s - max) * (1 / sum), as MLX's precise
// float32 softmax computes it (a `Softmax`).
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

// Each row of scores [G, S] replaced by its softmax for `attend`: the largest score by vector
// maxima (the same value in any order; a NaN score left out, as std::max leaves it), exp(s - max)
// as softmax_rows takes it, their sum in the vector's lanes (position s in lane s % kLanes) and
// then across them by halving (lane i plus lane i + w, w = kLanes / 2, ..., 1), each scaled by
// 1 / sum. A batch's left padding puts a row's positions after hidden ones, whose exponentials
// are exact zeros: each lane's sum is the same, only the lanes rotate, and a halving tree adds
// the same pairs in any rotation, so the row's bits do not depend on its padding. Within
// float32's rounding of MLX's softmax, not its bits: softmax_rows' running sum waits on each
// addition.
inline void attend_softmax(float* scores, int G, int S) {
  using V = typename Isa::V;
  const int full = S - S % Isa::kLanes;
  for (int g = 0; g < G; g++) {
    float* row = scores + static_cast<size_t>(g) * S;
    V most = Isa::set1(kLowest);
    for (int s = 0; s < full; s += Isa::kLanes) most = Isa::max(Isa::load(row + s), most);
    float lanes[Isa::kLanes];
    Isa::store(lanes, most);
    float top = kLowest;
    for (float lane : lanes) top = std::max(top, lane);
    for (int s = full; s < S; s++) top = std::max(top, row[s]);
    for (int s = 0; s < S; s++) row[s] = exp_poly(row[s] - top);
    V total = Isa::zero();
    for (int s = 0; s < full; s += Isa::kLanes) total = Isa::add(total, Isa::load(row + s));
    if (full < S) total = Isa::add(total, Isa::load_first(row + full, S - full));
    float part[Isa::kLanes];
    Isa::store(part, total);
    for (int w = Isa::kLanes / 2; w > 0; w /= 2)
      for (int i = 0; i < w; i++) part[i] += part[i + w];
    const float inverse = 1.0f / part[0];
    const V inv = Isa::set1(inverse);
    for (int s = 0; s < full; s += Isa::kLanes)
      Isa::store(row + s, Isa::mul(Isa::load(row + s), inv));
    for (int s = full; s < S; s++) row[s] *= inverse;
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
                         const bool* visible, int64_t visible_step, float* out, bool every) {
  by_heads(G, [&](int g0, auto heads) {
    group_values<decltype(heads)::value, 1>(p + static_cast<size_t>(g0) * S, 0, S, S, v, v_step, Dv,
                                            visible, visible_step, 0,
                                            out + static_cast<size_t>(g0) * Dv, 0, false, every);
  });
}

// Whether each of T query tokens' mask flags (a token's `token_step` after the one before's) shows
// each of S keys (`step` apart).
inline bool sees_all(const bool* visible, int64_t step, int64_t token_step, int T, int S) {
  for (int t = 0; t < T; t++)
    for (int s = 0; s < S; s++)
      if (!visible[t * token_step + s * step]) return false;
  return true;
}

// Whether a query token's S mask flags, `step` apart, show any key.
inline bool sees_any(const bool* visible, int64_t step, int S) {
  for (int s = 0; s < S; s++)
    if (visible[s * step]) return true;
  return false;
}

// out [G, Dv] = softmax(q [G, D] . k^T over the visible keys) . v: the G query heads of one
// row that share a KV head, q already scaled; keys and values are S rows `k_step` and `v_step`
// floats apart, the mask S flags `visible_step` apart. scores: G * S floats of scratch (an
// `Attend`). A hidden position weighs exactly zero and its value is not read (a NaN there stays
// out, where MLX's 0 * NaN would spread it). A row that sees no key at all weighs every
// position alike, as MLX's softmax over scores that are all the lowest float does.
inline void attend_token(const float* q, int G, int D, const float* k, int64_t k_step,
                         const float* v, int64_t v_step, int Dv, const bool* visible,
                         int64_t visible_step, int S, float* scores, float* out) {
  if (!sees_any(visible, visible_step, S)) {
    static const bool kEvery = true;
    std::fill(scores, scores + static_cast<size_t>(G) * S, kLowest);
    attend_softmax(scores, G, S);
    weigh_values(scores, G, S, v, v_step, Dv, &kEvery, 0, out, true);
    return;
  }
  const bool every = sees_all(visible, visible_step, 0, 1, S);  // no flag read again
  by_heads(G, [&](int g0, auto heads) {
    group_scores<decltype(heads)::value, 1>(q + static_cast<size_t>(g0) * D, 0, D, k, k_step,
                                            visible, visible_step, 0, S,
                                            scores + static_cast<size_t>(g0) * S, 0, S, every);
  });
  attend_softmax(scores, G, S);
  weigh_values(scores, G, S, v, v_step, Dv, visible, visible_step, out, every);
}

// part(t0, TN) over T tokens, TN of them (a compile-time constant, up to kTileTokens<GN>) at a
// time.
template <int GN, typename Part>
inline void by_tokens(int T, Part part) {
  for (int t0 = 0; t0 < T; t0 += kTileTokens<GN>) {
    switch (std::min(kTileTokens<GN>, T - t0)) {
      case 1: part(t0, std::integral_constant<int, 1>{}); break;
      case 2: part(t0, std::integral_constant<int, 2>{}); break;
      case 3: part(t0, std::integral_constant<int, 3>{}); break;
      default: part(t0, std::integral_constant<int, kTileTokens<GN>>{}); break;
    }
  }
}

// How many positions `attend` takes at a time: every tile of its tokens takes a block's keys (then
// values) while they are in the core's cache, instead of each tile reading the row's S keys and
// values from memory (a prompt chunk's tiles read them ~T / 4 times). Each score and each output's
// chain of multiply-adds over the positions is the same either way.
constexpr int kKeyBlock = 128;

// `attend_token` for T query tokens of one row at once: q [T, G, D], scores T * G * S floats of
// scratch, out [T, G, Dv]; token t's mask flags start `token_step` flags after token t - 1's. The
// tokens are taken in tiles of up to four (`by_tokens`), each tile reading a block of keys and
// values once for its tokens, and every tile a block at a time (kKeyBlock); every token's scores,
// softmax and weighted values are its own, in `attend_token`'s order, so its result is the same
// bits as alone. Tiles of four where a token sees no key at all, a token of them alone
// (`attend_token` itself).
inline void attend(const float* q, int T, int G, int D, const float* k, int64_t k_step,
                   const float* v, int64_t v_step, int Dv, const bool* visible,
                   int64_t visible_step, int64_t token_step, int S, float* scores, float* out) {
  bool each_sees = T > 1;
  for (int t = 0; t < T && each_sees; t++)
    each_sees = sees_any(visible + t * token_step, visible_step, S);
  if (!each_sees) {
    constexpr int kTile = kTileTokens<1>;  // the most tokens a tile takes
    if (T > kTile) {
      for (int t0 = 0; t0 < T; t0 += kTile)
        attend(q + static_cast<size_t>(t0) * G * D, std::min(kTile, T - t0), G, D, k, k_step, v,
               v_step, Dv, visible + t0 * token_step, visible_step, token_step, S, scores,
               out + static_cast<size_t>(t0) * G * Dv);
      return;
    }
    for (int t = 0; t < T; t++)
      attend_token(q + static_cast<size_t>(t) * G * D, G, D, k, k_step, v, v_step, Dv,
                   visible + t * token_step, visible_step, S, scores,
                   out + static_cast<size_t>(t) * G * Dv);
    return;
  }
  const int64_t q_token = static_cast<int64_t>(G) * D, s_token = static_cast<int64_t>(G) * S;
  const int64_t out_token = static_cast<int64_t>(G) * Dv;
  // part(s0, n, g0, t0, heads, tokens, flags, every) for each block of keys [s0, s0 + n) in
  // order, and in it each tile of `tokens` tokens (t0 on) of `heads` heads (g0 on): flags, the
  // tile's mask there; every, whether each of its tokens sees each of the block's keys.
  const auto tiles = [&](auto part) {
    for (int s0 = 0; s0 < S; s0 += kKeyBlock) {
      const int n = std::min(kKeyBlock, S - s0);
      by_heads(G, [&](int g0, auto heads) {
        by_tokens<decltype(heads)::value>(T, [&](int t0, auto tokens) {
          const bool* flags = visible + t0 * token_step + s0 * visible_step;
          part(s0, n, g0, t0, heads, tokens, flags,
               sees_all(flags, visible_step, token_step, decltype(tokens)::value, n));
        });
      });
    }
  };
  tiles([&](int s0, int n, int g0, int t0, auto heads, auto tokens, const bool* flags, bool every) {
    group_scores<decltype(heads)::value, decltype(tokens)::value>(
        q + t0 * q_token + g0 * D, q_token, D, k + s0 * k_step, k_step, flags, visible_step,
        token_step, n, scores + t0 * s_token + g0 * S + s0, s_token, S, every);
  });
  attend_softmax(scores, T * G, S);
  tiles([&](int s0, int n, int g0, int t0, auto heads, auto tokens, const bool* flags, bool every) {
    group_values<decltype(heads)::value, decltype(tokens)::value>(
        scores + t0 * s_token + g0 * S + s0, s_token, S, n, v + s0 * v_step, v_step, Dv, flags,
        visible_step, token_step, out + t0 * out_token + g0 * Dv, out_token, /*more=*/s0 > 0,
        every);
  });
}
