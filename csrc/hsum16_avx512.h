// hsum16: 16 vectors of 16 floats -> one vector whose lane j is the sum of v[j]'s
// lanes. Pairs of vectors interleaved and added (each 128-bit block then holds partial
// sums of two, then four vectors), then the four blocks folded: 45 instructions for 16
// sums instead of 16 reduction trees. Used where 16 dot products end at once: the
// decode attention's scores (attention_decode_avx512.h) and the decode GEMV's rows
// (bf16_gemv.cpp).
//
// No include guard and no includes: it is included inside a namespace (the AVX-512
// build of cpu_kernels_impl.h) as well as at namespace scope, once per translation
// unit, after <immintrin.h>.

__attribute__((target("avx512f,avx512dq"), always_inline)) inline __m512 hsum16(const __m512* v) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 x[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // x[i]'s block k: the block-k partial sums of v[4i .. 4i+3].
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}
