// The KV block pool (block_pool.cpp): reference counts, the LRU free-block
// queue and the hash -> block map over int block ids. The twin of
// python/enginecore/sched/block_pool.py (PyBlockPool): same interface, same results.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "hash_index.h"

namespace enginecore {

class BlockPool {
 public:
  BlockPool(int64_t num_blocks, bool enable_caching);

  int32_t num_blocks() const { return num_blocks_; }
  bool enable_caching() const { return enable_caching_; }
  int64_t num_free() const { return num_free_; }
  int64_t num_evictions() const { return num_evictions_; }
  size_t num_cached() const { return cached_.size(); }

  // Throws std::out_of_range (IndexError) for an id outside the pool.
  void check(int64_t block) const;
  int32_t ref_cnt(int32_t block) const { return ref_[block]; }
  bool has_hash(int32_t block) const { return has_hash_[block] != 0; }
  const Hash32& hash(int32_t block) const { return hash_[block]; }
  // The block registered under `h`, or -1.
  int32_t lookup(const Hash32& h) const;
  // The free queue, front (evicted first) to back.
  std::vector<int32_t> free_ids() const;

  // `n` blocks from the front of the free queue (their hashes evicted), ref 1,
  // appended to `out`. Throws std::invalid_argument when fewer are free.
  void take(int64_t n, std::vector<int32_t>& out);
  // One more reference (a cache hit); a free block leaves the free queue.
  void touch(int32_t block);
  // One reference less; at zero the block joins the back of the free queue.
  // Throws std::runtime_error on a double free.
  void release(int32_t block);
  // A hint that `h` is about to be cached or looked up.
  void prefetch(const Hash32& h) const { cached_.prefetch(h); }
  // Register a full block under `h` unless it has a hash or `h` is taken.
  void cache(int32_t block, const Hash32& h);
  // Forget the block's hash.
  void uncache(int32_t block);
  // Forget every hash; false (nothing changed) while any block is in use.
  bool reset();

 private:
  void unlink(int32_t block);

  int32_t num_blocks_;
  bool enable_caching_;
  int64_t num_free_;
  int64_t num_evictions_ = 0;
  int32_t head_, tail_;  // sentinels: num_blocks and num_blocks + 1
  std::vector<int32_t> ref_, prev_, next_;
  std::vector<Hash32> hash_;
  std::vector<uint8_t> has_hash_;
  HashIndex cached_;  // keyed by hash_[block]
};

// A Python block id as int64: TypeError for a non-int or one past int64.
int64_t block_id_of(pybind11::handle h);

}  // namespace enginecore
