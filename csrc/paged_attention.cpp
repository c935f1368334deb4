// Paged attention for CPU decode and chunked prefill <-> the torch twin in
// python/enginecore/model/attention.py (paged_attention_torch).
// One call per layer: writes the step's new K/V into the cache by slot, then
// attends every sequence's query tokens over its context, read in place
// through the block table (no gather), grouped-query heads sharing each K/V
// row, float64 arithmetic (rounded once, at the end) and an online softmax.
// Work items are (sequence, KV head, chunk of query tokens), spread over
// torch's OpenMP threads without the GIL.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_threads.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// Below this many multiply-adds a step's attention runs on the calling
// thread: waking the team costs more than it saves.
constexpr int64_t kParallelMinWork = 1 << 18;

struct AttnJob {
  const AttnParams* p;
  const std::vector<AttnItem>* items;
  int64_t scratch_doubles;
};

void run_item(void* ctx, int64_t i) {
  const auto* job = static_cast<const AttnJob*>(ctx);
  thread_local std::vector<double> scratch;
  if (static_cast<int64_t>(scratch.size()) < job->scratch_doubles) scratch.resize(job->scratch_doubles);
  cpu_kernels().attend(*job->p, (*job->items)[i], scratch.data());
}

void write_cache(uintptr_t new_kv, int64_t st, int64_t sh, uintptr_t cache, int64_t c_ss,
                 int64_t c_sh, const int64_t* slots, int64_t num_tokens, int kv_heads,
                 int64_t row_bytes, int64_t elem) {
  const auto* src = reinterpret_cast<const char*>(new_kv);
  auto* dst = reinterpret_cast<char*>(cache);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // a padding token: nothing to keep
    for (int h = 0; h < kv_heads; ++h) {
      std::memcpy(dst + (slot * c_ss + h * c_sh) * elem, src + (t * st + h * sh) * elem, row_bytes);
    }
  }
}

void paged_attention(uintptr_t out, int64_t out_st, int64_t out_sh, uintptr_t q, int64_t q_st,
                     int64_t q_sh, uintptr_t k_new, int64_t k_st, int64_t k_sh, uintptr_t v_new,
                     int64_t v_st, int64_t v_sh, uintptr_t slot_mapping, int64_t num_tokens,
                     uintptr_t k_cache, uintptr_t v_cache, int64_t c_ss, int64_t c_sh,
                     uintptr_t block_table, int64_t bt_stride, uintptr_t query_start,
                     uintptr_t seq_lens, int num_seqs, int num_heads, int num_kv_heads,
                     int head_dim, int block_size, int dtype, double scale, double soft_cap,
                     int sliding_window, int num_threads) {
  if (dtype != static_cast<int>(DType::kFloat32) && dtype != static_cast<int>(DType::kBFloat16)) {
    throw std::invalid_argument("paged_attention: dtype must be float32 or bfloat16");
  }
  if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 ||
      block_size <= 0 || num_seqs < 0) {
    throw std::invalid_argument("paged_attention: bad head or block sizes");
  }
  {
    const auto* qs = reinterpret_cast<const int32_t*>(query_start);
    const auto* lens = reinterpret_cast<const int32_t*>(seq_lens);
    for (int s = 0; s < num_seqs; ++s) {
      const int32_t qlen = qs[s + 1] - qs[s];
      if (qlen < 0 || lens[s] < qlen) {
        throw std::invalid_argument(
            "paged_attention: a sequence has fewer context positions than query tokens");
      }
    }
  }
  AttnParams p{};
  p.dtype = static_cast<DType>(dtype);
  p.out = reinterpret_cast<void*>(out);
  p.out_st = out_st;
  p.out_sh = out_sh;
  p.q = reinterpret_cast<const void*>(q);
  p.q_st = q_st;
  p.q_sh = q_sh;
  p.k_cache = reinterpret_cast<const void*>(k_cache);
  p.v_cache = reinterpret_cast<const void*>(v_cache);
  p.c_ss = c_ss;
  p.c_sh = c_sh;
  p.block_table = reinterpret_cast<const int32_t*>(block_table);
  p.bt_stride = bt_stride;
  p.query_start = reinterpret_cast<const int32_t*>(query_start);
  p.seq_lens = reinterpret_cast<const int32_t*>(seq_lens);
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.sliding_window = sliding_window;

  const int G = num_heads / num_kv_heads;
  const int chunk = G >= kMaxRows ? 1 : kMaxRows / G;
  std::vector<AttnItem> items;
  int64_t work = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int qlen = p.query_start[s + 1] - p.query_start[s];
    for (int q0 = 0; q0 < qlen; q0 += chunk) {
      const int q1 = q0 + chunk < qlen ? q0 + chunk : qlen;
      for (int h = 0; h < num_kv_heads; ++h) items.push_back(AttnItem{s, h, q0, q1});
      work += static_cast<int64_t>(G) * (q1 - q0) * p.seq_lens[s] * head_dim * num_kv_heads;
    }
  }
  const int rows = G * (chunk < 1 ? 1 : chunk);
  AttnJob job{&p, &items, attn_scratch_doubles(rows, head_dim)};
  const int64_t elem = p.dtype == DType::kBFloat16 ? 2 : 4;
  const auto* slots = reinterpret_cast<const int64_t*>(slot_mapping);
  py::gil_scoped_release release;
  // Every new K/V row of the step lands before any query reads the cache.
  if (k_new != 0) {
    write_cache(k_new, k_st, k_sh, k_cache, c_ss, c_sh, slots, num_tokens, num_kv_heads,
                head_dim * elem, elem);
    write_cache(v_new, v_st, v_sh, v_cache, c_ss, c_sh, slots, num_tokens, num_kv_heads,
                head_dim * elem, elem);
  }
  parallel_for(static_cast<int64_t>(items.size()), work < kParallelMinWork ? 1 : num_threads,
               run_item, &job);
}

}  // namespace

void bind_paged_attention(py::module_& m) {
  m.def("paged_attention", &paged_attention, py::arg("out"), py::arg("out_st"),
        py::arg("out_sh"), py::arg("q"), py::arg("q_st"), py::arg("q_sh"), py::arg("k_new"),
        py::arg("k_st"), py::arg("k_sh"), py::arg("v_new"), py::arg("v_st"), py::arg("v_sh"),
        py::arg("slot_mapping"), py::arg("num_tokens"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("c_ss"), py::arg("c_sh"), py::arg("block_table"), py::arg("bt_stride"),
        py::arg("query_start"), py::arg("seq_lens"), py::arg("num_seqs"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("dtype"),
        py::arg("scale"), py::arg("soft_cap"), py::arg("sliding_window"),
        py::arg("num_threads"),
        "Write the step's K/V into the paged cache (k_new=0: skip) and attend every "
        "sequence's query tokens over its context through its block table. Pointers are "
        "tensor data_ptr()s, strides in elements; dtype 0 = float32, 1 = bfloat16.");
}

}  // namespace enginecore
