// Greedy sampling's argmax over rows of logits (bf16 or fp32), compiled per
// instruction set beside cpu_kernels_impl.h (whose dtype helpers it uses).
// torch.argmax's answer exactly: the first index of the maximum; a NaN counts
// as the maximum (its first index wins). One pass of block maxima (vectorized),
// then the first block that reached the final maximum is searched again.
// (argmax_row: also the random sampler's first pass, cpu_kernels_sample_impl.h.)

template <typename T>
int64_t argmax_row(const T* x, int n) {
  constexpr int kBlock = 256;
  float best = -__builtin_inff();
  int best_block = 0;
  bool nan = false;
  for (int b0 = 0; b0 < n; b0 += kBlock) {
    const int b1 = b0 + kBlock < n ? b0 + kBlock : n;
    float m = -__builtin_inff();
    int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
    for (int i = b0; i < b1; ++i) {
      const float v = to_f32(x[i]);
      m = v > m ? v : m;
      bad |= v != v;
    }
    if (bad) {
      nan = true;
      break;
    }
    if (m > best) {
      best = m;
      best_block = b0;
    }
  }
  int64_t found = 0;
  if (nan) {
    for (int i = 0; i < n; ++i) {
      const float v = to_f32(x[i]);
      if (v != v) {
        found = i;
        break;
      }
    }
  } else {
    for (int i = best_block; i < n; ++i) {
      if (to_f32(x[i]) == best) {
        found = i;
        break;
      }
    }
  }
  return found;
}

template <typename T>
void argmax_rows_t(const ArgmaxParams& p, int64_t r0, int64_t r1) {
  for (int64_t row = r0; row < r1; ++row) {
    p.out[row] = argmax_row(static_cast<const T*>(p.x) + row * p.row_stride, p.cols);
  }
}

void argmax_rows(const ArgmaxParams& p, int64_t r0, int64_t r1) {
  if (p.dtype == DType::kBFloat16) {
    argmax_rows_t<bf16>(p, r0, r1);
  } else {
    argmax_rows_t<float>(p, r0, r1);
  }
}
