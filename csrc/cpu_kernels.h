// CPU model kernels (paged attention, RMSNorm, RoPE, SiLU-and-mul, argmax): their
// parameter blocks and the per-instruction-set table cpu_kernels() picks.
// Tensors arrive as raw pointers and element strides from Python (no libtorch).
#pragma once

#include <cstdint>
#include <stdexcept>

namespace enginecore {

struct bf16 {
  uint16_t bits;
};

enum class DType : int { kFloat32 = 0, kBFloat16 = 1 };

// A binding's dtype code as a DType; anything else is refused (ValueError in Python).
inline DType check_dtype(int dtype) {
  if (dtype != static_cast<int>(DType::kFloat32) && dtype != static_cast<int>(DType::kBFloat16)) {
    throw std::invalid_argument("dtype must be 0 (float32) or 1 (bfloat16)");
  }
  return static_cast<DType>(dtype);
}

// Positions per tile of the attention's online softmax.
constexpr int kTile = 32;
// Work items with at least this many query rows compute scores from a
// transposed K tile (see attend_item).
constexpr int kTransposedMinRows = 8;
// At most this many query rows (tokens x heads of one KV head) per work item.
constexpr int kMaxRows = 64;

struct AttnParams {
  DType dtype;
  void* out;  // [tokens, heads, head_dim]
  int64_t out_st, out_sh;
  const void* q;  // [tokens, heads, head_dim], strided (a view of the fused qkv)
  int64_t q_st, q_sh;
  const void* k_cache;  // [slots, kv_heads, head_dim]
  const void* v_cache;
  int64_t c_ss, c_sh;
  const int32_t* block_table;  // [seqs, bt_stride]
  int64_t bt_stride;
  const int32_t* query_start;  // [seqs + 1] first query token of each sequence
  const int32_t* seq_lens;     // [seqs] context length including this step's tokens
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  double scale;
  double soft_cap;     // <= 0: none
  int sliding_window;  // <= 0: none
};

struct AttnItem {
  int seq, kvh, q0, q1;
};

// Doubles of scratch one work item needs (see attend_item's layout; the
// positions' ints take a slot each).
inline int64_t attn_scratch_doubles(int rows, int head_dim) {
  return 2LL * rows * head_dim + static_cast<int64_t>(rows) * kTile + 3LL * rows +
         static_cast<int64_t>(kTile) * head_dim + 16;
}

struct RmsNormParams {
  DType dtype;
  void* x;  // [rows, hidden]; with delta, h + delta is written back here
  int64_t x_stride;
  const void* delta;  // nullptr: no residual add
  int64_t delta_stride;
  const void* weight;
  void* out;
  int64_t out_stride;
  int hidden;
  double eps;
};

struct RopeParams {
  DType dtype;
  void* x;  // [tokens, heads, head_dim], rotated in place
  int64_t x_st, x_sh;
  const int64_t* positions;
  const void* cos;  // [max_positions, table_stride] in the model dtype
  const void* sin;
  int64_t table_stride;
  int num_heads, rotary_dim;
};

struct SiluMulParams {
  DType dtype;
  const void* x;  // [rows, 2 * width]: gate | up
  int64_t x_stride;
  void* out;  // [rows, width]
  int64_t out_stride;
  int width;
};

struct ArgmaxParams {
  DType dtype;
  const void* x;  // [rows, cols]
  int64_t row_stride;
  int cols;
  int64_t* out;  // [rows]
};

// Random sampling from logits (dropped tokens -inf; the temperature applied here or
// before): the exponential race with each row's Exp(1) variables hashed from its key.
struct SampleParams {
  DType dtype;
  const void* x;  // [rows, cols], float32 or bf16 (dtype)
  int64_t row_stride;
  int cols;
  // [rows] float32 or null: the row is x / temperature[r] in float32 (as torch divides)
  const float* temperature;
  const int64_t* keys;  // [rows]
  int64_t* out;         // [rows]
};

// Top-p in place on float32 logits: what falls outside each row's nucleus becomes -inf.
struct TopPParams {
  float* x;  // [rows, cols]
  int64_t row_stride;
  int cols;
  const double* top_p;  // [rows], each in (0, 1]
};

// Logprobs of the raw logits, one sampled (or target) token and the top n per row,
// without a [rows, vocab] tensor of logprobs (cpu_kernels_logprobs_impl.h).
struct LogprobParams {
  DType dtype;
  const void* x;  // [rows, cols], float32 or bf16
  int64_t row_stride;
  int cols;
  const int64_t* tokens;  // [rows], each in [0, cols)
  int n;                  // top logprobs a row, in [0, cols]
  float* token_lp;        // [rows]
  int64_t* rank;          // [rows]
  int64_t* top_ids;       // [rows, n]
  float* top_lp;          // [rows, n]
};

struct CpuKernels {
  const char* isa;
  void (*attend)(const AttnParams&, const AttnItem&, double* scratch);
  void (*rms_norm)(const RmsNormParams&, int64_t row_begin, int64_t row_end);
  void (*rope)(const RopeParams&, int64_t token_begin, int64_t token_end);
  void (*silu_and_mul)(const SiluMulParams&, int64_t row_begin, int64_t row_end);
  void (*argmax)(const ArgmaxParams&, int64_t row_begin, int64_t row_end);
  void (*sample)(const SampleParams&, int64_t row_begin, int64_t row_end);
  void (*top_p)(const TopPParams&, int64_t row_begin, int64_t row_end);
  void (*logprobs)(const LogprobParams&, int64_t row_begin, int64_t row_end);
};

// The best variant this CPU runs (AVX-512, AVX2 or baseline), chosen once.
const CpuKernels& cpu_kernels();

}  // namespace enginecore
