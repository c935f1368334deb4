// The request table, twin of python/enginecore/sched/request_table.py (PyRequestTable).
#include "request_table.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "pyref.h"
#include "sha256.h"

namespace py = pybind11;

namespace enginecore {

RequestTable::RequestTable(py::object pool, int64_t block_size)
    : pool_obj_(std::move(pool)), block_size_(block_size) {
  if (block_size <= 0) {
    throw py::value_error("block_size must be positive, got " + std::to_string(block_size));
  }
  if (!pool_obj_.is_none()) pool_ = &pool_obj_.cast<BlockPool&>();
}

BlockPool& RequestTable::pool() {
  if (pool_ == nullptr) {
    throw std::runtime_error(
        "this request table has no block pool (a request not yet added to a scheduler "
        "holds no KV blocks)");
  }
  return *pool_;
}

void RequestTable::no_row(int64_t slot) {
  throw py::index_error("no request in slot " + std::to_string(slot));
}

int64_t RequestTable::put(std::unique_ptr<Row> r) {
  int64_t slot;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
    rows_[slot] = std::move(r);
  } else {
    slot = static_cast<int64_t>(rows_.size());
    rows_.push_back(std::move(r));
  }
  ++live_;
  return slot;
}

void RequestTable::release(int64_t slot) {
  Row& r = row(slot);
  if (!r.blocks.empty()) {
    throw std::runtime_error("slot " + std::to_string(slot) + " still holds " +
                             std::to_string(r.blocks.size()) + " blocks");
  }
  // The row object stays (a loop may hold it); its contents go.
  r = Row();
  r.request_id = py::none();
  free_.push_back(slot);
  --live_;
}

void check_hashable(const int64_t* begin, const int64_t* end) {
  for (; begin != end; ++begin) {
    if (*begin < 0 || *begin > 0xFFFFFFFFLL) throw py::value_error("token ids must be in [0, 2**32)");
  }
}

void RequestTable::extend_hashes(Row& r) {
  if (!r.hash_blocks) return;
  const size_t bs = static_cast<size_t>(block_size_);
  const size_t done = r.hashes.size();
  // Called per token: most calls fill no block (a product, not a division, says so).
  if (r.tokens.size() < (done + 1) * bs) return;
  const size_t full = r.tokens.size() / bs;
  uint8_t root[32] = {0};
  const size_t tail_len = 4 * bs + r.extra_keys.size();
  if (full - done == 1 && done >= r.block_extra_keys.size() && 32 + tail_len <= kShortMessage) {
    // The decode step's case: one block just filled, no keys of its own: its
    // ids and keys on the stack, one chain step (the chain below allocates).
    uint8_t tail[kShortMessage];
    const int64_t* src = r.tokens.data() + done * bs;
    for (size_t i = 0; i < bs; ++i) {
      if (src[i] < 0 || src[i] > 0xFFFFFFFFLL) {
        throw py::value_error("token ids must be in [0, 2**32)");
      }
      const uint32_t id = static_cast<uint32_t>(src[i]);
      std::memcpy(tail + 4 * i, &id, 4);  // little endian, as the chain writes them
    }
    if (!r.extra_keys.empty()) {
      std::memcpy(tail + 4 * bs, r.extra_keys.data(), r.extra_keys.size());
    }
    Hash32 h;
    sha256_after(done ? r.hashes[done - 1].b : root, tail, tail_len, h.b);
    r.hashes.push_back(h);
    return;
  }
  std::vector<uint32_t> block(bs);
  // Each digest stays put while this call runs: the chain reads it back. Grow
  // geometrically: reserving exactly `full` reallocated (copied every hash of the
  // row) at each new block, quadratic over a long generation.
  if (r.hashes.capacity() < full) r.hashes.reserve(std::max(full, 2 * r.hashes.capacity()));
  size_t b = done;
  // Blocks with their own keys (multimodal items): one message each,
  // parent || tokens || block keys || extra keys.
  const size_t keyed_end = std::min(full, r.block_extra_keys.size());
  std::string msg;
  for (; b < keyed_end; ++b) {
    const int64_t* src = r.tokens.data() + b * bs;
    for (size_t i = 0; i < bs; ++i) {
      if (src[i] < 0 || src[i] > 0xFFFFFFFFLL) {
        throw py::value_error("token ids must be in [0, 2**32)");
      }
      block[i] = static_cast<uint32_t>(src[i]);
    }
    msg.assign(reinterpret_cast<const char*>(b ? r.hashes[b - 1].b : root), 32);
    msg.append(reinterpret_cast<const char*>(block.data()), 4 * bs);
    msg += r.block_extra_keys[b];
    msg += r.extra_keys;
    r.hashes.emplace_back();
    sha256(reinterpret_cast<const uint8_t*>(msg.data()), msg.size(), r.hashes.back().b);
  }
  if (b >= full) return;
  const uint8_t* parent = b ? r.hashes[b - 1].b : root;
  Sha256Chain chain(parent, 4 * bs, reinterpret_cast<const uint8_t*>(r.extra_keys.data()),
                    r.extra_keys.size());
  for (; b < full; ++b) {
    const int64_t* src = r.tokens.data() + b * bs;
    for (size_t i = 0; i < bs; ++i) {
      if (src[i] < 0 || src[i] > 0xFFFFFFFFLL) {
        throw py::value_error("token ids must be in [0, 2**32)");
      }
      block[i] = static_cast<uint32_t>(src[i]);
    }
    r.hashes.emplace_back();
    chain.next(reinterpret_cast<const uint8_t*>(block.data()), r.hashes.back().b);
  }
}

int32_t RequestTable::check_stop(Row& r, int64_t max_model_len) {
  const int64_t n_all = static_cast<int64_t>(r.tokens.size());
  const int64_t n_out = n_all - r.num_prompt;
  if (n_all >= max_model_len || n_out >= r.max_tokens) {
    r.status = kLength;
    return kStopLength;
  }
  if (n_out < r.min_tokens || n_out <= 0) return kNotStopped;
  const int64_t last = r.tokens.back();
  if (last == r.eos_token_id && !r.ignore_eos) {
    r.status = kStopped;
    return kStopEos;
  }
  if (std::binary_search(r.stop_token_ids.begin(), r.stop_token_ids.end(), last)) {
    r.status = kStopped;
    return kStopToken;
  }
  return kNotStopped;
}

void RequestTable::cache_full(Row& r, int64_t end) {
  const int64_t n_tok = static_cast<int64_t>(r.tokens.size());
  int64_t num_full = std::min(end, n_tok) / block_size_;
  num_full = std::min<int64_t>(num_full, static_cast<int64_t>(r.hashes.size()));
  if (num_full <= r.num_cached_blocks) return;
  if (num_full > static_cast<int64_t>(r.blocks.size())) {
    throw py::index_error("blocks [" + std::to_string(r.num_cached_blocks) + ", " +
                          std::to_string(num_full) + ") out of range");
  }
  BlockPool& p = pool();
  for (int64_t i = r.num_cached_blocks; i < num_full; ++i) p.cache(r.blocks[i], r.hashes[i]);
  r.num_cached_blocks = num_full;
}

bool RequestTable::allocate(Row& r, int64_t num_new_tokens, int64_t num_new_computed,
                            const std::vector<int32_t>& new_computed, int64_t num_lookahead,
                            int64_t max_model_len, std::vector<int32_t>& new_blocks) {
  BlockPool& p = pool();
  if (num_new_tokens < 0 || num_new_computed < 0 || num_lookahead < 0) {
    throw py::value_error("token counts must be >= 0");
  }
  if (num_new_tokens == 0 && new_computed.empty()) {
    throw py::value_error("num_new_tokens must be positive");
  }
  const int64_t bs = block_size_;
  // Sums saturate: counts near int64's end (a hostile caller's) must not wrap
  // into small ones; every result they reach equals Python's exact ints.
  const auto add = [](int64_t x, int64_t y) {
    int64_t out;
    return __builtin_add_overflow(x, y, &out) ? INT64_MAX : out;
  };
  const int64_t num_computed = add(r.num_computed, num_new_computed);
  const int64_t num_needed =
      std::min(add(add(num_computed, num_new_tokens), num_lookahead), max_model_len);
  const int64_t num_new = (num_needed / bs + (num_needed % bs > 0)) -
                          static_cast<int64_t>(r.blocks.size()) -
                          static_cast<int64_t>(new_computed.size());
  int64_t num_revived = 0;
  for (int32_t b : new_computed) num_revived += p.ref_cnt(b) == 0;
  if (num_new > p.num_free() - num_revived) return false;
  for (int32_t b : new_computed) {
    p.touch(b);
    r.blocks.push_back(b);
  }
  if (num_new > 0) {
    const size_t first = r.blocks.size();
    p.take(num_new, r.blocks);
    new_blocks.insert(new_blocks.end(), r.blocks.begin() + first, r.blocks.end());
  }
  if (p.enable_caching()) cache_full(r, add(num_computed, num_new_tokens));
  return true;
}

void RequestTable::free_blocks(Row& r) {
  r.num_cached_blocks = 0;
  if (r.blocks.empty()) return;
  std::vector<int32_t> blocks;
  blocks.swap(r.blocks);
  BlockPool& p = pool();
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) p.release(*it);
}

}  // namespace enginecore
