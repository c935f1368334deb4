// Logprobs of the raw logits <-> python/enginecore/model/sampler.py logprob_rows_torch.
// Compiled per instruction set after cpu_kernels_sample_impl.h (exp_f64, log_f64,
// argmax_row). Per row x (float32; bf16 widened):
//   m = max x (a NaN counts as the maximum); a row whose m is not finite (NaN, +inf,
//   or every entry -inf) has NaN logprobs;
//   lp_j = float((x_j - m) - log(sum_k exp(x_k - m))), in float64, rounded once;
//   rank of token t = 1 + #{j : x_j > x_t} (a NaN is never greater);
//   the top n in the order (x desc, index asc), NaN above +inf, -0 below +0.
// What torch's log_softmax / topk / compare-and-sum did in ~5 ms for 32 x 49k rows
// (three passes writing a [rows, vocab] tensor), here in three read-only passes
// (max; the sum of exponentials with the rank's count; the top n, skipping blocks
// whose max cannot enter) and lp computed for the n + 1 tokens returned only.
// Against the twin: the sum in another order and log_f64 against torch.log, ~1e-16
// apart in float64: the float32 logprobs are equal unless one falls that close to a
// rounding boundary.

// A float's place in the total order above: NaN (any) over +inf, -0 under +0.
inline uint32_t order_key(float v) {
  if (v != v) return 0xFFC00000u;  // past +inf (0x7F800000 | sign bit -> 0xFF800000)
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct TopEntry {
  uint32_t key;
  int index;
};

// Insert (key, j) into `best` (sorted by key desc, index asc; at most n kept). The
// scan runs j upwards, so an equal key goes after the ones already there.
inline void offer(std::vector<TopEntry>& best, int n, uint32_t key, int j) {
  if (static_cast<int>(best.size()) == n) {
    if (key <= best.back().key) return;
    best.pop_back();
  }
  size_t at = best.size();
  while (at > 0 && best[at - 1].key < key) --at;
  best.insert(best.begin() + static_cast<std::ptrdiff_t>(at), TopEntry{key, j});
}

template <typename T>
void top_n_row(const T* x, int cols, int n, std::vector<TopEntry>& best) {
  best.clear();
  if (n == 0) return;
  constexpr int kBlock = 256;
  for (int b0 = 0; b0 < cols; b0 += kBlock) {
    const int b1 = b0 + kBlock < cols ? b0 + kBlock : cols;
    if (static_cast<int>(best.size()) == n) {
      // Skip a block with no NaN whose max is under the n-th best (float order is
      // the key order there; +0 / -0 against a -0 / +0 n-th best is scanned).
      float m = -__builtin_inff();
      int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int j = b0; j < b1; ++j) {
        const float v = to_f32(x[j]);
        nan |= v != v;
        m = v > m ? v : m;
      }
      const uint32_t worst = best.back().key;
      if (!nan && order_key(m) < worst) continue;
    }
    for (int j = b0; j < b1; ++j) offer(best, n, order_key(to_f32(x[j])), j);
  }
}

struct LogprobScratch {
  std::vector<TopEntry> best;
};

template <typename T>
void logprob_row(const LogprobParams& p, int64_t row, LogprobScratch& s) {
  const T* x = static_cast<const T*>(p.x) + row * p.row_stride;
  const int n = p.cols;
  const float top = to_f32(x[argmax_row(x, n)]);
  const int64_t t = p.tokens[row];
  const float xt = to_f32(x[t]);
  int64_t greater = 0;
  double sum = 0.0;
  const double m = top;
#pragma omp simd reduction(+ : sum, greater)
  for (int j = 0; j < n; ++j) {
    const float v = to_f32(x[j]);
    greater += v > xt;
    sum += exp_f64(static_cast<double>(v) - m);
  }
  const bool finite = top - top == 0.0f;
  const double log_sum = finite ? log_f64(sum) : 0.0;
  auto lp = [&](int j) -> float {
    if (!finite) return __builtin_nanf("");
    return static_cast<float>((static_cast<double>(to_f32(x[j])) - m) - log_sum);
  };
  p.token_lp[row] = lp(static_cast<int>(t));
  p.rank[row] = greater + 1;
  top_n_row(x, n, p.n, s.best);
  for (int i = 0; i < p.n; ++i) {
    p.top_ids[row * p.n + i] = s.best[i].index;
    p.top_lp[row * p.n + i] = lp(s.best[i].index);
  }
}

void logprob_rows(const LogprobParams& p, int64_t r0, int64_t r1) {
  thread_local LogprobScratch scratch;
  scratch.best.reserve(static_cast<size_t>(p.n) + 1);
  for (int64_t row = r0; row < r1; ++row) {
    if (p.dtype == DType::kBFloat16) {
      logprob_row<bf16>(p, row, scratch);
    } else {
      logprob_row<float>(p, row, scratch);
    }
  }
}
