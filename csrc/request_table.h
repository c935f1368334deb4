// The scheduler's per-request hot state (request_table.cpp), one row per
// request addressed by an int slot: tokens, counts, stop parameters, block
// table and block hashes. The twin of python/enginecore/sched/request_table.py
// (PyRequestTable); the loops in scheduler_loops.cpp work on the rows directly.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "block_pool.h"

namespace enginecore {

// RequestStatus values (python/enginecore/request.py).
enum Status : int32_t { kWaiting = 0, kRunning = 1, kPreempted = 2, kStopped = 3, kLength = 4 };
// check_stop's answer.
enum StopWhy : int32_t { kNotStopped = 0, kStopLength = 1, kStopEos = 2, kStopToken = 3 };

struct Row {
  pybind11::object request_id;  // None while the slot is free
  std::vector<int64_t> tokens;  // prompt then output
  int64_t num_prompt = 0;
  int64_t num_computed = 0;
  int32_t status = kWaiting;
  int64_t client_index = 0;
  int64_t max_tokens = 0;
  int64_t min_tokens = 0;
  int64_t eos_token_id = -1;  // -1: none
  bool ignore_eos = false;
  std::vector<int64_t> stop_token_ids;  // sorted
  bool has_grammar = false;
  std::vector<int64_t> spec;  // draft tokens for the next step
  int64_t priority = 0;
  double arrival_time = 0.0;
  std::string extra_keys;  // encoded (sched/block_hash.py encode_extra_keys)
  bool hash_blocks = false;
  std::vector<Hash32> hashes;
  std::vector<int32_t> blocks;
  int64_t num_cached_blocks = 0;
  // Per prompt block: encoded keys hashed before extra_keys (the identifiers of
  // the multimodal items the block overlaps); empty or past the end: none.
  std::vector<std::string> block_extra_keys;
};

// ValueError unless every token fits block hashing's 4 bytes, [0, 2**32).
void check_hashable(const int64_t* begin, const int64_t* end);

class RequestTable {
 public:
  // `pool`: a BlockPool, or None for a table whose requests hold no blocks yet.
  RequestTable(pybind11::object pool, int64_t block_size);

  int64_t block_size() const { return block_size_; }
  pybind11::object pool_object() const { return pool_obj_; }
  // The pool (throws when the table has none).
  BlockPool& pool();
  bool caching() const { return pool_ != nullptr && pool_->enable_caching(); }

  // The row in `slot` (throws IndexError for a free or unknown slot). Inline:
  // the scheduler's loops call it a few times per request per step.
  Row& row(int64_t slot) {
    if (slot < 0 || static_cast<size_t>(slot) >= rows_.size()) no_row(slot);
    Row* r = rows_[static_cast<size_t>(slot)].get();
    if (r == nullptr || r->request_id.is_none()) no_row(slot);
    return *r;
  }
  int64_t put(std::unique_ptr<Row> row);
  void release(int64_t slot);
  int64_t live() const { return live_; }
  size_t capacity() const { return rows_.size(); }
  Row* maybe_row(size_t slot) { return rows_[slot].get(); }

  // Hash the blocks the row's tokens filled since the last call.
  void extend_hashes(Row& r);
  // Scheduler's stop checks on the last token; sets status when stopped.
  int32_t check_stop(Row& r, int64_t max_model_len);
  // KVCacheManager.allocate_slots (see request_table.py); false: nothing changed.
  bool allocate(Row& r, int64_t num_new_tokens, int64_t num_new_computed,
                const std::vector<int32_t>& new_computed, int64_t num_lookahead,
                int64_t max_model_len, std::vector<int32_t>& new_blocks);
  // Register the row's blocks full of computed tokens, up to token `end`.
  void cache_full(Row& r, int64_t end);
  // Release the row's blocks, tail first.
  void free_blocks(Row& r);

 private:
  [[noreturn]] static void no_row(int64_t slot);
  pybind11::object pool_obj_;
  BlockPool* pool_ = nullptr;
  int64_t block_size_;
  // unique_ptr: a Row stays put while rows are added (a loop may hold one).
  std::vector<std::unique_ptr<Row>> rows_;
  std::vector<int64_t> free_;
  int64_t live_ = 0;
};

}  // namespace enginecore
