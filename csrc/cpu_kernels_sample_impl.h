// Random sampling from float32 or bf16 logits (divided by a per-row temperature here
// when asked), one draw per row <->
// python/enginecore/model/sampler.py sample_rows_torch. Compiled per instruction set
// beside cpu_kernels_impl.h (exp_f64) and cpu_kernels_argmax_impl.h (argmax_row).
//
// The exponential race, as before: token = argmax_j w_j / E_j with w_j = exp(x_j - max)
// and E_j ~ Exp(1), a draw from softmax(x). What changed is where E_j comes from:
// torch's exponential_ took ~19 ns an entry here (~30 ms a step for 32 rows of a 49k
// vocabulary, as long as the model's own step); here E_j = -log(u_j) with u_j from a
// counter-based hash of (the row's key, j), which the twin computes in torch bit for
// bit, so both race the same E_j (docs/benchmarks.md, round 10). The race, not the
// inverse of the running sum: a tiny change of the logits (a batch of another shape)
// moves the inverse's draw ~20x more often, and a seed should give the same tokens
// whatever the batch.
//
// u_j = ((mix64(key + (j + 1) * golden) >> 12) + 0.5) * 2^-52, in (0, 1), exact in
// double on both sides; exp_f64 / log_f64 here and torch's exp / log there agree to
// a few double ulp: the argmax can differ only where two ratios tie that closely. A
// row whose max is NaN or infinite gives its argmax (torch's rule); -inf (dropped by
// top-k / top-p / min-p) has weight 0 and never wins against a positive one.

#define ECK_INLINE inline __attribute__((always_inline))

// splitmix64's finalizer (Steele, Lea, Flood 2014): a bijection of 64-bit words whose
// outputs of consecutive inputs pass BigCrush.
ECK_INLINE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// log of a positive normal double: x = 2^e m with m in [sqrt(1/2), sqrt(2)),
// log(m) = 2 atanh(s) for s = (m - 1) / (m + 1), |s| <= 0.1716, by its series to s^25
// (the rest under 2^-60), e ln2 added in two parts: within a few double ulp.
// (Integers become doubles through the 2^52 bit pattern, not a conversion: AVX2 has
// no vector int64 -> double.)
ECK_INLINE double log_f64(double x) {
  const int64_t bits = __builtin_bit_cast(int64_t, x);
  // The biased exponent as a double: 2^52 + e_biased, less 2^52 (exact).
  const double biased =
      __builtin_bit_cast(double, ((bits >> 52) & 0x7ff) | 0x4330000000000000LL) - 0x1p52;
  double m = __builtin_bit_cast(double, (bits & 0x000fffffffffffffLL) | 0x3ff0000000000000LL);
  const bool big = m > 1.4142135623730951;
  m = big ? m * 0.5 : m;
  const double ed = biased - (big ? 1022.0 : 1023.0);
  const double f = m - 1.0;  // exact (Sterbenz)
  const double s = f / (2.0 + f);
  const double z = s * s;
  double p = 1.0 / 25.0;
  p = p * z + 1.0 / 23.0;
  p = p * z + 1.0 / 21.0;
  p = p * z + 1.0 / 19.0;
  p = p * z + 1.0 / 17.0;
  p = p * z + 1.0 / 15.0;
  p = p * z + 1.0 / 13.0;
  p = p * z + 1.0 / 11.0;
  p = p * z + 1.0 / 9.0;
  p = p * z + 1.0 / 7.0;
  p = p * z + 1.0 / 5.0;
  p = p * z + 1.0 / 3.0;
  const double log_m = 2.0 * s + 2.0 * s * (z * p);
  return ed * 6.93147180369123816490e-01 + (log_m + ed * 1.90821492927058770002e-10);
}

// The race's Exp(1) variable of position j of a row keyed by `key`.
ECK_INLINE double race_exponential(uint64_t key, int64_t j) {
  const uint64_t z = mix64(key + static_cast<uint64_t>(j + 1) * 0x9E3779B97F4A7C15ULL);
  // 1 + k 2^-52 (k: the top 52 bits), less 1, plus 2^-53: (k + 0.5) 2^-52, exactly.
  const double u =
      (__builtin_bit_cast(double, (z >> 12) | 0x3ff0000000000000ULL) - 1.0) + 0x1p-53;
  return -log_f64(u);
}

// The first index of the maximum of r[0, n) (no NaN reaches here: w / E >= 0): block
// maxima (vectorized), then the first block that holds the maximum searched again.
inline int64_t first_max(const double* r, int n) {
  constexpr int kBlock = 256;
  double best = -1.0;
  int best_block = 0;
  for (int b0 = 0; b0 < n; b0 += kBlock) {
    const int b1 = b0 + kBlock < n ? b0 + kBlock : n;
    double m = -1.0;
#pragma omp simd reduction(max : m)
    for (int j = b0; j < b1; ++j) m = r[j] > m ? r[j] : m;
    if (m > best) {
      best = m;
      best_block = b0;
    }
  }
  for (int j = best_block; j < n; ++j) {
    if (r[j] == best) return j;
  }
  return 0;
}

int64_t sample_row(const float* x, int n, uint64_t key, double* ratio) {
  const int64_t a = argmax_row(x, n);
  const float top = x[a];
  if (!(top - top == 0.0f)) return a;  // NaN or +-inf: no distribution
  const double m = top;
#pragma omp simd
  for (int j = 0; j < n; ++j) {
    ratio[j] = exp_f64(static_cast<double>(x[j]) - m) / race_exponential(key, j);
  }
  return first_max(ratio, n);
}

// Row r as float32 into dst: bf16 widened (exact), divided by the temperature in
// float32 (correctly rounded, as torch's logits.float() / t): the twin's bits.
template <typename T>
void scale_row(const T* x, int n, const float* temperature, float* dst) {
  if (temperature == nullptr) {
#pragma omp simd
    for (int j = 0; j < n; ++j) dst[j] = to_f32(x[j]);
    return;
  }
  const float t = *temperature;
#pragma omp simd
  for (int j = 0; j < n; ++j) dst[j] = to_f32(x[j]) / t;
}

template <typename T>
void sample_rows_t(const SampleParams& p, int64_t r0, int64_t r1) {
  // One row of ratios (and of scaled logits) per thread, kept between calls.
  thread_local std::vector<double> ratio;
  thread_local std::vector<float> scaled;
  const size_t n = static_cast<size_t>(p.cols);
  if (ratio.size() < n) ratio.resize(n);
  const bool as_is = std::is_same<T, float>::value && p.temperature == nullptr;
  if (!as_is && scaled.size() < n) scaled.resize(n);
  for (int64_t row = r0; row < r1; ++row) {
    const T* x = static_cast<const T*>(p.x) + row * p.row_stride;
    const float* xf;
    if (as_is) {
      xf = reinterpret_cast<const float*>(x);
    } else {
      scale_row(x, p.cols, p.temperature ? p.temperature + row : nullptr, scaled.data());
      xf = scaled.data();
    }
    p.out[row] = sample_row(xf, p.cols, static_cast<uint64_t>(p.keys[row]), ratio.data());
  }
}

void sample_rows(const SampleParams& p, int64_t r0, int64_t r1) {
  if (p.dtype == DType::kBFloat16) {
    sample_rows_t<bf16>(p, r0, r1);
  } else {
    sample_rows_t<float>(p, r0, r1);
  }
}

// -- top-p ---------------------------------------------------------------------------
// <-> python/enginecore/model/sampler.py top_p_rows_torch. Rank the row by (x desc,
// index asc); keep token i iff the weight of the tokens ranked above it (w = exp(x -
// max), float64) is < p * sum w; the rest become -inf. The kept tokens are a prefix of
// that order, so only its last one is looked for: weights summed into buckets linear
// in x (kTopPBuckets over [max - 708, max]: below, exp is 0 here), the bucket the
// target falls in ranked by a sort of its few tokens, then one pass writes -inf. The
// twin sorts the whole row (~2 ms a 49k row); sums in another order: ~1e-16 apart.
// A row whose max is NaN or infinite, or whose p is 1, is left as it is.

constexpr int kTopPBuckets = 2048;

struct TopPScratch {
  std::vector<double> w, bucket_w;
  std::vector<int> bucket_of;
  std::vector<std::pair<float, int>> tied;  // the boundary bucket's (x, index)
};

void top_p_row(float* x, int n, double p, TopPScratch& s) {
  if (p >= 1.0) return;  // the whole row
  const int64_t a = argmax_row(x, n);
  const float top = x[a];
  if (!(top - top == 0.0f)) return;  // NaN or +-inf: left alone
  const double m = top;
  const double lo = m - 708.0;
  s.w.resize(n);
  s.bucket_of.resize(n);
  s.bucket_w.assign(kTopPBuckets, 0.0);
  const double scale = kTopPBuckets / 708.0;
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int j = 0; j < n; ++j) {
    const double d = static_cast<double>(x[j]) - m;
    const double e = exp_f64(d);
    s.w[j] = e;
    total += e;
    // Monotone in x; -1: weight 0 (below max - 708, or -inf).
    const double f = (static_cast<double>(x[j]) - lo) * scale;
    s.bucket_of[j] = f >= 0.0 ? (f < kTopPBuckets ? static_cast<int>(f) : kTopPBuckets - 1) : -1;
  }
  for (int j = 0; j < n; ++j) {
    if (s.bucket_of[j] >= 0) s.bucket_w[s.bucket_of[j]] += s.w[j];
  }
  const double target = p * total;
  double above = 0.0;  // weight of the buckets over b
  int b = kTopPBuckets - 1;
  for (; b >= 0; --b) {
    if (above + s.bucket_w[b] >= target) break;
    above += s.bucket_w[b];
  }
  if (b < 0) return;  // the sums fell short of p * total (rounding): keep the row
  s.tied.clear();
  for (int j = 0; j < n; ++j) {
    if (s.bucket_of[j] == b) s.tied.emplace_back(x[j], j);
  }
  std::sort(s.tied.begin(), s.tied.end(), [](const auto& l, const auto& r) {
    return l.first > r.first || (l.first == r.first && l.second < r.second);
  });
  // The last token kept: the last in rank order whose weight above is < target.
  float last_x = s.tied.front().first;
  int last_j = s.tied.front().second;
  for (const auto& [v, j] : s.tied) {
    if (above >= target) break;
    last_x = v;
    last_j = j;
    above += s.w[j];
  }
  for (int j = 0; j < n; ++j) {
    const bool keep = x[j] > last_x || (x[j] == last_x && j <= last_j);
    if (!keep) x[j] = -__builtin_inff();
  }
}

void top_p_rows(const TopPParams& p, int64_t r0, int64_t r1) {
  thread_local TopPScratch scratch;
  for (int64_t row = r0; row < r1; ++row) {
    top_p_row(p.x + row * p.row_stride, p.cols, p.top_p[row], scratch);
  }
}

#undef ECK_INLINE
