// Decode attention on AVX-512 registers <-> attend_item (cpu_kernels_impl.h), whose
// few-rows branch it replaces where it applies; the torch twin is
// python/enginecore/model/attention.py paged_attention_torch.
// Included by cpu_kernels_impl.h only inside cpu_kernels.cpp's AVX-512 namespace
// (ECK_AVX512_DECODE), after the helpers it uses (to_f32, from_f32, exp_f64, ...).
//
// Why: a decode item is the G query heads of one KV head (3 rows on the default
// model). The generic branch dotted every (row, position) pair with a horizontal
// sum of its own and added each V row into accumulators kept in memory. Here the
// queries and the accumulators stay in L1 for the whole item, the scores of 8
// positions come out of one transpose-and-add tree (hsum8d), and each K and V row
// is widened once, in registers, for all rows.
//
// Same arithmetic as attend_item (float64 products, sums and softmax, rounded once
// at the end), sums in another order: ~1e-16 apart, the same bits after the rounding.

// 8 values of a row widened to float64 in registers (bf16 and float32 fit exactly).
ECK_INLINE __m512d load8d(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
ECK_INLINE __m512d load8d(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
}

// 8 vectors of 8 doubles -> one vector whose lane j is the sum of v[j]'s lanes: pairs
// interleaved and added (each 128-bit block then holds partial sums of two vectors),
// then the blocks folded twice.
ECK_INLINE __m512d hsum8d(const __m512d* v) {
  __m512d w[4];
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm512_add_pd(_mm512_unpacklo_pd(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_pd(v[2 * i], v[2 * i + 1]));
  }
  const __m512d x0 = _mm512_add_pd(_mm512_shuffle_f64x2(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f64x2(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512d x1 = _mm512_add_pd(_mm512_shuffle_f64x2(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f64x2(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_pd(_mm512_shuffle_f64x2(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f64x2(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The K and V rows of positions [t0, min(t0 + kTile - 1, hi)] asked into L2. The rows
// are scattered over the cache (a 64- or 128-value row per block position and
// head, blocks anywhere): waited for one by one, their misses kept a core at a
// quarter of its streaming rate. One tile ahead, into L2 (_MM_HINT_T1: into L1
// the requests overflowed its miss buffers and ran no faster), doubled the rate
// on 64 decodes at context 1k (docs/benchmarks.md).
template <typename T, int D>
ECK_INLINE void prefetch_rows(const AttnParams& p, const int32_t* table, int64_t head_off, int t0,
                              int hi) {
  const int bs = p.block_size;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  for (int t = t0; t <= hi && t < t0 + kTile; ++t) {
    const int64_t o =
        ((static_cast<int64_t>(table[t / bs]) * bs + t % bs) * p.c_ss + head_off) * sizeof(T);
    for (int i = 0; i < static_cast<int>(D * sizeof(T)); i += 64) {
      _mm_prefetch(kc + o + i, _MM_HINT_T1);
      _mm_prefetch(vc + o + i, _MM_HINT_T1);
    }
  }
}

// Vectors of a row's accumulators one pass over a tile's V rows updates: as many as
// keep R rows of them, the V row's slice and the weight in registers (at most 16
// accumulators and 8 slice vectors of 32).
constexpr int pv_vectors(int R, int C) {
  int cc = 1;
  while (cc * 2 <= C && cc * 2 <= 8 && R * cc * 2 <= 16) cc *= 2;
  return cc;
}

// One work item with R = G * (q1 - q0) rows and head_dim D (a multiple of 16).
template <typename T, int D, int R>
void attend_decode_avx512(const AttnParams& p, const AttnItem& it) {
  constexpr int C = D / 8;  // vectors of 8 doubles per row
  constexpr int CC = pv_vectors(R, C);
  const int G = p.num_heads / p.num_kv_heads;
  const T* q = static_cast<const T*>(p.q);
  const auto [qstart, first_pos, lo, hi] = item_span(p, it);
  const __m512d scale = _mm512_set1_pd(p.scale);
  // Scaled queries and the accumulators, in L1: the scores read the queries as
  // FMA operands, each V pass loads and stores a slice of the accumulators once
  // per tile (rescaled by the row's softmax correction on the way in).
  alignas(64) double Q[R][D];
  alignas(64) double A[R][D];
  double m[R], l[R], corr[R];
  int qpos[R];
  for (int r = 0; r < R; ++r) {
    const int i = it.q0 + r / G;
    const int h = it.kvh * G + r % G;
    const T* src = q + static_cast<int64_t>(qstart + i) * p.q_st + static_cast<int64_t>(h) * p.q_sh;
    for (int c = 0; c < C; ++c) {
      _mm512_store_pd(&Q[r][8 * c], _mm512_mul_pd(load8d(src + 8 * c), scale));
      _mm512_store_pd(&A[r][8 * c], _mm512_setzero_pd());
    }
    m[r] = -__builtin_inf();
    l[r] = 0.0;
    qpos[r] = first_pos + i;
  }
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int32_t* table = p.block_table + static_cast<int64_t>(it.seq) * p.bt_stride;
  const int bs = p.block_size;
  const int64_t head_off = static_cast<int64_t>(it.kvh) * p.c_sh;
  prefetch_rows<T, D>(p, table, head_off, lo, hi);
  alignas(64) double S[R][kTile];
  __m512d P[R][8];  // per row, 8 positions' lane-wise partial dot products
  int64_t off[kTile];  // each position's row, from the start of either cache
  for (int t0 = lo; t0 <= hi; t0 += kTile) {
    const int n = hi - t0 + 1 < kTile ? hi - t0 + 1 : kTile;
    for (int j = 0; j < n; ++j) {  // a tile may span blocks: each position's slot
      const int t = t0 + j;
      off[j] = (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * p.c_ss + head_off;
    }
    // The next tile's rows, while this one computes.
    prefetch_rows<T, D>(p, table, head_off, t0 + kTile, hi);
    // Scores, 8 positions at a time: each K row widened once for all R rows.
    for (int j0 = 0; j0 < n; j0 += 8) {
      const int nj = n - j0 < 8 ? n - j0 : 8;
      for (int jj = 0; jj < nj; ++jj) {
        __m512d k[C];
        for (int c = 0; c < C; ++c) k[c] = load8d(kc + off[j0 + jj] + 8 * c);
        for (int r = 0; r < R; ++r) {
          __m512d s = _mm512_mul_pd(_mm512_load_pd(&Q[r][0]), k[0]);
          for (int c = 1; c < C; ++c) s = _mm512_fmadd_pd(_mm512_load_pd(&Q[r][8 * c]), k[c], s);
          P[r][jj] = s;
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int jj = nj; jj < 8; ++jj) P[r][jj] = _mm512_setzero_pd();
        _mm512_store_pd(&S[r][j0], hsum8d(P[r]));
      }
    }
    // Soft cap, masks, online softmax (attend_item's); the accumulators' rescale is
    // left to the V pass.
    for (int r = 0; r < R; ++r) corr[r] = softmax_tile_row(p, S[r], n, t0, qpos[r], m[r], l[r]);
    // Values, CC vectors of every row's accumulators per pass: each V row's slice
    // widened once, added into every row.
    for (int c0 = 0; c0 < C; c0 += CC) {
      __m512d acc[R][CC];
      for (int r = 0; r < R; ++r) {
        // A factor of 0 drops what came before (an inf V too), as in attend_item.
        const __m512d cv = _mm512_set1_pd(corr[r]);
        for (int c = 0; c < CC; ++c) {
          acc[r][c] = corr[r] == 0.0 ? _mm512_setzero_pd()
                                     : _mm512_mul_pd(_mm512_load_pd(&A[r][8 * (c0 + c)]), cv);
        }
      }
      for (int j = 0; j < n; ++j) {
        const T* vp = vc + off[j] + 8 * c0;
        __m512d v[CC];
        for (int c = 0; c < CC; ++c) v[c] = load8d(vp + 8 * c);
        for (int r = 0; r < R; ++r) {
          // A weight of 0 (a masked position, an exp below double's range) adds
          // nothing, even times a NaN or inf V row, as in attend_item.
          if (S[r][j] == 0.0) continue;
          const __m512d w = _mm512_set1_pd(S[r][j]);
          for (int c = 0; c < CC; ++c) acc[r][c] = _mm512_fmadd_pd(w, v[c], acc[r][c]);
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < CC; ++c) _mm512_store_pd(&A[r][8 * (c0 + c)], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) write_row<T>(p, it, qstart, r, G, D, A[r], l[r]);
}

// The item on registers when its shape has a path here; false: the caller's
// generic branch runs it.
template <typename T, int D>
bool attend_decode_fast(const AttnParams& p, const AttnItem& it) {
  switch (p.num_heads / p.num_kv_heads * (it.q1 - it.q0)) {
    case 1: attend_decode_avx512<T, D, 1>(p, it); return true;
    case 2: attend_decode_avx512<T, D, 2>(p, it); return true;
    case 3: attend_decode_avx512<T, D, 3>(p, it); return true;
    case 4: attend_decode_avx512<T, D, 4>(p, it); return true;
    case 5: attend_decode_avx512<T, D, 5>(p, it); return true;
    case 6: attend_decode_avx512<T, D, 6>(p, it); return true;
    case 7: attend_decode_avx512<T, D, 7>(p, it); return true;
    case 8: attend_decode_avx512<T, D, 8>(p, it); return true;
    default: return false;
  }
}
