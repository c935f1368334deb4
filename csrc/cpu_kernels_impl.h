// The CPU model kernels' bodies. cpu_kernels.cpp includes this file once per
// instruction set, inside a namespace named for it and under a matching
// `#pragma GCC target`, so the compiler vectorizes the same loops for
// AVX-512, AVX2 and the baseline; the dispatcher picks one by CPUID.
// No includes here: cpu_kernels.cpp provides them (and cpu_kernels.h's types).
//
// Numerics: inputs bf16 or fp32, all arithmetic in fp32. The element-wise
// kernels (RMSNorm, RoPE, SiLU-and-mul) round to the model dtype exactly where
// their torch twins do, so for bf16 they give the twin's bits except where
// the fp32 reduction order or exp differs by an ulp before a rounding.

#define ECK_INLINE inline __attribute__((always_inline))

// -- dtype access ----------------------------------------------------------------------
ECK_INLINE float to_f32(float x) { return x; }
ECK_INLINE float to_f32(bf16 x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16);
}
ECK_INLINE void from_f32(float x, float* dst) { *dst = x; }
// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN.
ECK_INLINE void from_f32(float x, bf16* dst) {
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  dst->bits = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}
// x rounded to the model dtype and back: where the torch twin stores an
// intermediate tensor in that dtype.
ECK_INLINE float round_to(float x, const float*) { return x; }
ECK_INLINE float round_to(float x, const bf16*) {
  bf16 b;
  from_f32(x, &b);
  return to_f32(b);
}

// exp (Cephes' polynomial on a range-reduced argument, ~2 ulp), written so the
// compiler vectorizes it: exp(-inf) and anything below -88 is 0, anything above
// expf's overflow point (88.72...) is +inf as expf gives (SiLU's x / (1 + exp(-x))
// must reach -0 for a huge negative x, NaN for -inf), (88, 88.72] is 2 exp(x - ln 2)
// (2^n past n = 127 would not fit the exponent trick below), NaN stays NaN.
ECK_INLINE float fast_exp(float x) {
  const float x_in = x;
  const bool high = x > 88.0f;
  x = high ? x - 0.693147180559945f : x;
  x = x < -88.0f ? -88.0f : (x > 88.3f ? 88.3f : x);  // 88.3: n <= 127 below
  // n = round(x / ln 2) by the 1.5 * 2^23 shift (no floorf: it keeps loops scalar
  // below SSE4.1 and under GCC's target pragmas); its low bits are n itself.
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n as float bits; n = -127 at the clamp gives 0, so exp(-inf) is exactly 0.
  const int32_t e = (__builtin_bit_cast(int32_t, shifted) - 0x4B400000) + 127;
  const float y = p * __builtin_bit_cast(float, e << 23);
  const float scaled = high ? 2.0f * y : y;
  return x_in >= 88.72283935546875f ? __builtin_inff() : scaled;  // expf's overflow
}

ECK_INLINE float fast_tanh(float x) {
  float a = x < 0 ? -x : x;
  float t = 1.0f - 2.0f / (fast_exp(2.0f * (a > 44.0f ? 44.0f : a)) + 1.0f);
  return x < 0 ? -t : t;
}

// -- paged attention -------------------------------------------------------------------
// Where one work item sits: its sequence's first query token in q / out (qstart),
// the position of that sequence's first query token (first_pos), and the positions
// [lo, hi] its rows may see (hi: its last token's; lo: 0, or the window's start).
struct ItemSpan {
  int qstart, first_pos, lo, hi;
};
ECK_INLINE ItemSpan item_span(const AttnParams& p, const AttnItem& it) {
  const int qstart = p.query_start[it.seq];
  const int first_pos = p.seq_lens[it.seq] - (p.query_start[it.seq + 1] - qstart);
  int lo = 0;
  if (p.sliding_window > 0) {
    lo = first_pos + it.q0 - p.sliding_window + 1;
    if (lo < 0) lo = 0;
  }
  return {qstart, first_pos, lo, first_pos + it.q1 - 1};
}

// One row's scores of one tile (positions t0 .. t0 + n - 1; the row's own position
// qp): soft cap, causal / window mask, then the online softmax: the scores become
// weights against the running max m (updated with the running sum l). Returns the
// factor what the row accumulated before must be scaled by (1 when the max stayed,
// and when nothing in the tile is visible: weights 0, m and l untouched).
ECK_INLINE float softmax_tile_row(const AttnParams& p, float* sr, int n, int t0, int qp,
                                  float& m, float& l) {
  if (p.soft_cap > 0.0f) {
    const float cap = p.soft_cap, inv = 1.0f / p.soft_cap;
#pragma omp simd
    for (int j = 0; j < n; ++j) sr[j] = cap * fast_tanh(sr[j] * inv);
  }
  const int win = p.sliding_window;
  // Mask only tiles that reach past the row's position or out of its window
  // (a decode row never does: its position is the last one).
  if (t0 + n - 1 > qp || (win > 0 && qp - t0 >= win)) {
    for (int j = 0; j < n; ++j) {
      const int t = t0 + j;
      const bool ok = t <= qp && (win <= 0 || qp - t < win);
      sr[j] = ok ? sr[j] : -__builtin_inff();
    }
  }
  float mt = -__builtin_inff();
#pragma omp simd reduction(max : mt)
  for (int j = 0; j < n; ++j) mt = sr[j] > mt ? sr[j] : mt;
  if (mt == -__builtin_inff()) {  // nothing visible in this tile: weights 0
    for (int j = 0; j < n; ++j) sr[j] = 0.0f;
    return 1.0f;
  }
  const float m_new = mt > m ? mt : m;
  const float corr = fast_exp(m - m_new);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < n; ++j) {
    sr[j] = fast_exp(sr[j] - m_new);
    sum += sr[j];
  }
  l = l * corr + sum;
  m = m_new;
  return corr;
}

// One work item: the query tokens [q0, q1) of sequence `seq` (rows: each token's
// G query heads of KV head `kvh`) against that sequence's cached context, read
// in place through its block table; online softmax over tiles of positions.
template <typename T, int DC>
void attend_item(const AttnParams& p, const AttnItem& it, float* buf) {
  const int D = DC > 0 ? DC : p.head_dim;
  const int G = p.num_heads / p.num_kv_heads;
  const int nq = it.q1 - it.q0;
  const int R = G * nq;
  float* Q = buf;                    // [R][D] scaled queries
  float* acc = Q + R * D;            // [R][D]
  float* S = acc + R * D;            // [R][kTile] scores, then probabilities
  float* m = S + R * kTile;          // [R] running max
  float* l = m + R;                  // [R] running sum
  float* kf = l + R;                 // [kTile][D] the tile's K (or V) in fp32
  int* qpos = reinterpret_cast<int*>(kf + kTile * D);  // [R]

  const T* q = static_cast<const T*>(p.q);
  const auto [qstart, first_pos, lo, hi] = item_span(p, it);
  for (int r = 0; r < R; ++r) {
    const int i = it.q0 + r / G;
    const int h = it.kvh * G + r % G;
    const T* src = q + static_cast<int64_t>(qstart + i) * p.q_st + static_cast<int64_t>(h) * p.q_sh;
    float* dst = Q + r * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * p.scale;
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[r * D + d] = 0.0f;
    m[r] = -__builtin_inff();
    l[r] = 0.0f;
    qpos[r] = first_pos + i;
  }
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int32_t* table = p.block_table + static_cast<int64_t>(it.seq) * p.bt_stride;
  const int bs = p.block_size;
  const int64_t head_off = static_cast<int64_t>(it.kvh) * p.c_sh;
  int64_t slots[kTile];
  for (int t0 = lo; t0 <= hi; t0 += kTile) {
    const int n = hi - t0 + 1 < kTile ? hi - t0 + 1 : kTile;
    for (int j = 0; j < n; ++j) {  // a tile may span blocks: each position's slot
      const int t = t0 + j;
      slots[j] = static_cast<int64_t>(table[t / bs]) * bs + t % bs;
    }
    if (R >= kTransposedMinRows) {
      // Many rows (prefill): the tile's K in fp32, transposed to [D][kTile]
      // (zero past n), so a row's scores are kTile-wide vector multiply-adds
      // with no horizontal sums; the transpose is paid once for all rows.
      for (int j = 0; j < n; ++j) {
        const T* kp = kc + slots[j] * p.c_ss + head_off;
        for (int d = 0; d < D; ++d) kf[d * kTile + j] = to_f32(kp[d]);
      }
      if (n < kTile) {
        for (int d = 0; d < D; ++d) {
          for (int j = n; j < kTile; ++j) kf[d * kTile + j] = 0.0f;
        }
      }
      for (int r = 0; r < R; ++r) {
        const float* qr = Q + r * D;
        float sc[kTile];
#pragma omp simd
        for (int j = 0; j < kTile; ++j) sc[j] = 0.0f;
        for (int d = 0; d < D; ++d) {
          const float qd = qr[d];
          const float* kd = kf + d * kTile;
#pragma omp simd
          for (int j = 0; j < kTile; ++j) sc[j] += qd * kd[j];
        }
        float* sr = S + r * kTile;
#pragma omp simd
        for (int j = 0; j < kTile; ++j) sr[j] = sc[j];
      }
    } else {
      // Few rows (decode: the G heads of one KV head): each K row converted
      // once and dotted with every row; a transpose would cost more than it saves.
      for (int j = 0; j < n; ++j) {
        const T* kp = kc + slots[j] * p.c_ss + head_off;
        float* kr = kf + j * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) kr[d] = to_f32(kp[d]);
      }
      for (int r = 0; r < R; ++r) {
        const float* qr = Q + r * D;
        for (int j = 0; j < n; ++j) {
          const float* kr = kf + j * D;
          float sc = 0.0f;
#pragma omp simd reduction(+ : sc)
          for (int d = 0; d < D; ++d) sc += qr[d] * kr[d];
          S[r * kTile + j] = sc;
        }
      }
    }
    // Soft cap, masks, online softmax: per row, rescale what was accumulated
    // when the max grows, then turn the tile's scores into weights.
    for (int r = 0; r < R; ++r) {
      const float corr = softmax_tile_row(p, S + r * kTile, n, t0, qpos[r], m[r], l[r]);
      if (corr != 1.0f) {
        float* ar = acc + r * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ar[d] *= corr;
      }
    }
    // Values: each V row converted once (into the K tile's buffer, now free),
    // added into every row that sees it.
    for (int j = 0; j < n; ++j) {
      const T* vp = vc + slots[j] * p.c_ss + head_off;
      float* vr = kf + j * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) vr[d] = to_f32(vp[d]);
    }
    for (int r = 0; r < R; ++r) {
      float* ar = acc + r * D;
      const float* sr = S + r * kTile;
      for (int j = 0; j < n; ++j) {
        const float w = sr[j];
        if (w == 0.0f) continue;
        const float* vr = kf + j * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ar[d] += w * vr[d];
      }
    }
  }
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < R; ++r) {
    const int i = it.q0 + r / G;
    const int h = it.kvh * G + r % G;
    T* dst = out + static_cast<int64_t>(qstart + i) * p.out_st + static_cast<int64_t>(h) * p.out_sh;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const float* ar = acc + r * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) from_f32(ar[d] * inv, dst + d);
  }
}

#ifdef ECK_AVX512_DECODE
#include "attention_decode_avx512.h"
#endif

template <typename T>
void attend(const AttnParams& p, const AttnItem& it, float* buf) {
#ifdef ECK_AVX512_DECODE
  // Few rows (decode): on registers where the head size has a path there.
  if (p.head_dim == 64 && attend_decode_fast<T, 64>(p, it)) return;
  if (p.head_dim == 128 && attend_decode_fast<T, 128>(p, it)) return;
#endif
  switch (p.head_dim) {
    case 64: return attend_item<T, 64>(p, it, buf);
    case 128: return attend_item<T, 128>(p, it, buf);
    default: return attend_item<T, 0>(p, it, buf);
  }
}

void attend_items(const AttnParams& p, const AttnItem& it, float* buf) {
  if (p.dtype == DType::kBFloat16) {
    attend<bf16>(p, it, buf);
  } else {
    attend<float>(p, it, buf);
  }
}

// -- RMSNorm (+ residual add) ----------------------------------------------------------
// Rows [r0, r1): with a residual, h = round(h + delta) is written back into
// `residual` first (torch: `h = h + delta`); then out = w * round(h * rsqrt(mean(h^2) + eps))
// (transformers' LlamaRMSNorm: normalise in fp32, scale in the model dtype).
template <typename T>
void rms_norm_rows(const RmsNormParams& p, int64_t r0, int64_t r1) {
  const int n = p.hidden;
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t row = r0; row < r1; ++row) {
    T* h = static_cast<T*>(p.x) + row * p.x_stride;
    const T* delta = p.delta ? static_cast<const T*>(p.delta) + row * p.delta_stride : nullptr;
    T* out = static_cast<T*>(p.out) + row * p.out_stride;
    float ss = 0.0f;
    if (delta != nullptr) {
#pragma omp simd reduction(+ : ss)
      for (int i = 0; i < n; ++i) {
        float v = round_to(to_f32(h[i]) + to_f32(delta[i]), h);
        from_f32(v, h + i);
        ss += v * v;
      }
    } else {
#pragma omp simd reduction(+ : ss)
      for (int i = 0; i < n; ++i) {
        float v = to_f32(h[i]);
        ss += v * v;
      }
    }
    const float inv = 1.0f / __builtin_sqrtf(ss / static_cast<float>(n) + p.eps);
#pragma omp simd
    for (int i = 0; i < n; ++i) {
      float normed = round_to(to_f32(h[i]) * inv, h);
      from_f32(to_f32(w[i]) * normed, out + i);
    }
  }
}

void rms_norm(const RmsNormParams& p, int64_t r0, int64_t r1) {
  if (p.dtype == DType::kBFloat16) {
    rms_norm_rows<bf16>(p, r0, r1);
  } else {
    rms_norm_rows<float>(p, r0, r1);
  }
}

// -- RoPE (rotate-half / NeoX layout), in place ------------------------------------------
// Per token and head: x1, x2 = halves of the first rotary_dim values;
// x1' = round(round(x1 c) + round(-x2 s)), x2' = round(round(x2 c) + round(x1 s)),
// with c, s from the model-dtype tables, as `x * cos + rotate_half(x) * sin` in torch.
// No fused multiply-add here: torch rounds each product before the sum, and so
// must we for the twin's (and transformers') bits in float32.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_rows(const RopeParams& p, int64_t r0,
                                                             int64_t r1) {
  const int half = p.rotary_dim / 2;
  const T* cos_t = static_cast<const T*>(p.cos);
  const T* sin_t = static_cast<const T*>(p.sin);
  for (int64_t tok = r0; tok < r1; ++tok) {
    const int64_t pos = p.positions[tok];
    const T* c = cos_t + pos * p.table_stride;
    const T* s = sin_t + pos * p.table_stride;
    for (int h = 0; h < p.num_heads; ++h) {
      T* x = static_cast<T*>(p.x) + tok * p.x_st + static_cast<int64_t>(h) * p.x_sh;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
        const float c1 = to_f32(c[i]), s1 = to_f32(s[i]);
        const float c2 = to_f32(c[i + half]), s2 = to_f32(s[i + half]);
        const float y1 = round_to(x1 * c1, x) + round_to(-x2 * s1, x);
        const float y2 = round_to(x2 * c2, x) + round_to(x1 * s2, x);
        from_f32(y1, x + i);
        from_f32(y2, x + i + half);
      }
    }
  }
}

void rope(const RopeParams& p, int64_t r0, int64_t r1) {
  if (p.dtype == DType::kBFloat16) {
    rope_rows<bf16>(p, r0, r1);
  } else {
    rope_rows<float>(p, r0, r1);
  }
}

// -- SiLU(gate) * up ---------------------------------------------------------------------
// gate | up side by side in each input row: out = round(round(silu(g)) * u),
// as `F.silu(gate) * up` in the model dtype.
// Two loops over chunks of a row (silu into a float buffer, then the product):
// one loop with the bf16 loads made GCC take 16 lanes per AVX2 iteration and
// spill the exp's constants (1.65x slower).
template <typename T>
void silu_and_mul_rows(const SiluMulParams& p, int64_t r0, int64_t r1) {
  constexpr int kChunk = 256;
  alignas(64) float act[kChunk];
  const int n = p.width;
  for (int64_t row = r0; row < r1; ++row) {
    const T* g = static_cast<const T*>(p.x) + row * p.x_stride;
    const T* u = g + n;
    T* out = static_cast<T*>(p.out) + row * p.out_stride;
    for (int c0 = 0; c0 < n; c0 += kChunk) {
      const int m = n - c0 < kChunk ? n - c0 : kChunk;
#pragma omp simd
      for (int i = 0; i < m; ++i) {
        const float gv = to_f32(g[c0 + i]);
        act[i] = gv / (1.0f + fast_exp(-gv));
      }
#pragma omp simd
      for (int i = 0; i < m; ++i) {
        from_f32(round_to(act[i], out) * to_f32(u[c0 + i]), out + c0 + i);
      }
    }
  }
}

void silu_and_mul(const SiluMulParams& p, int64_t r0, int64_t r1) {
  if (p.dtype == DType::kBFloat16) {
    silu_and_mul_rows<bf16>(p, r0, r1);
  } else {
    silu_and_mul_rows<float>(p, r0, r1);
  }
}

#undef ECK_INLINE
