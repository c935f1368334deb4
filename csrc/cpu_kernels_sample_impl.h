// Random sampling from float32 logits, one draw per row <->
// python/enginecore/model/sampler.py sample_rows_torch. Compiled per instruction set
// beside cpu_kernels_impl.h (exp_f64) and cpu_kernels_argmax_impl.h (argmax_row).
//
// Why: the sampler drew an Exp(1) variable per vocabulary entry (the exponential
// race, torch's exponential_: ~19 ns an entry here) and took argmax(p / E): ~30 ms a
// step for 32 rows of a 49k vocabulary, as long as the model's own step. One
// uniform per row and the inverse of the running sum draw from the same
// distribution in two passes over the row (docs/benchmarks.md, round 10).
//
// Per row: a = the argmax (torch's rule); a max that is NaN or infinite gives a (no
// distribution to draw from). Otherwise w_j = exp(x_j - max) in float64 (masked
// -inf gives 0), and the token is the first j whose running sum of w passes u * sum
// w: tokens of weight 0 are never drawn. The twin computes the same sums in
// another order (~1e-16 apart): a draw can differ only where u * sum falls that
// close to a running sum. When the scan ends without passing (u * sum rounded up
// to the sum), the last token of nonzero weight.

// Weights summed per block of the scan: the block that passes the target is
// walked again position by position.
constexpr int kSampleBlock = 64;

int64_t sample_row(const float* x, int n, double u, double* w) {
  const int64_t a = argmax_row(x, n);
  const float top = x[a];
  if (!(top - top == 0.0f)) return a;  // NaN or +-inf
  const double m = top;
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int j = 0; j < n; ++j) {
    const double e = exp_f64(static_cast<double>(x[j]) - m);
    w[j] = e;
    total += e;
  }
  const double target = u * total;
  double run = 0.0;
  for (int b0 = 0; b0 < n; b0 += kSampleBlock) {
    const int b1 = b0 + kSampleBlock < n ? b0 + kSampleBlock : n;
    double block = 0.0;
#pragma omp simd reduction(+ : block)
    for (int j = b0; j < b1; ++j) block += w[j];
    if (run + block <= target) {
      run += block;
      continue;
    }
    double cum = run;
    for (int j = b0; j < b1; ++j) {
      cum += w[j];
      if (cum > target) return j;
    }
    run = cum;  // the sums of the block in order fell short: on to the next
  }
  for (int j = n - 1; j >= 0; --j) {
    if (w[j] > 0.0) return j;
  }
  return a;
}

void sample_rows(const SampleParams& p, int64_t r0, int64_t r1) {
  // One row of weights per thread, kept between calls (a vocabulary's worth).
  thread_local std::vector<double> w;
  if (w.size() < static_cast<size_t>(p.cols)) w.resize(static_cast<size_t>(p.cols));
  for (int64_t row = r0; row < r1; ++row) {
    p.out[row] = sample_row(p.x + row * p.row_stride, p.cols, p.u[row], w.data());
  }
}
