// The prefix cache's map from block hash to block id: open addressing with
// linear probing over 8-byte slots {tag, block}. The keys themselves stay in
// the pool's per-block hash array (passed to every call), so a probe touches
// one cache line of slots and the 32-byte key only on a tag match; an insert
// allocates nothing (std::unordered_map allocated a node per cached block and
// chased a pointer per probe: ~5 % of an engine step at 256 decodes).
// Deletion shifts the following entries back (no tombstones), so probe chains
// stay as short as the load factor (<= 1/2) makes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace enginecore {

// A block hash: SHA-256, 32 bytes.
struct Hash32 {
  uint8_t b[32];
  bool operator==(const Hash32& o) const { return std::memcmp(b, o.b, 32) == 0; }
};

class HashIndex {
 public:
  HashIndex() : slots_(kMinSlots, Slot{0, kEmpty}), mask_(kMinSlots - 1) {}

  size_t size() const { return size_; }

  // The block registered under h, or -1.
  int32_t find(const Hash32& h, const Hash32* keys) const {
    const uint32_t t = tag(h);
    for (size_t i = home(h);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.block == kEmpty) return -1;
      if (s.tag == t && keys[s.block] == h) return s.block;
    }
  }

  // Asks for the cache line an insert or find of h probes first (a hint: the
  // table is megabytes, and a step caches a block per running request).
  void prefetch(const Hash32& h) const { __builtin_prefetch(&slots_[home(h)], 1); }

  // Registers `block` under keys[block]; false (nothing changed) when that
  // hash is registered already.
  bool insert(int32_t block, const Hash32* keys) {
    if (2 * (size_ + 1) > slots_.size()) grow(keys);
    const Hash32& h = keys[block];
    const uint32_t t = tag(h);
    size_t i = home(h);
    for (;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.block == kEmpty) break;
      if (s.tag == t && keys[s.block] == h) return false;
    }
    slots_[i] = Slot{t, block};
    ++size_;
    return true;
  }

  // Forgets `block` if it is the one registered under keys[block].
  void erase(int32_t block, const Hash32* keys) {
    size_t i = home(keys[block]);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].block == kEmpty) return;
      if (slots_[i].block == block) break;
    }
    // Backward shift: pull later entries of the chain into the hole unless
    // their home lies cyclically in (hole, j].
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; slots_[j].block != kEmpty; j = (j + 1) & mask_) {
      const size_t k = home(keys[slots_[j].block]);
      const bool stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
      if (stays) continue;
      slots_[hole] = slots_[j];
      hole = j;
    }
    slots_[hole] = Slot{0, kEmpty};
    --size_;
  }

  void clear() {
    slots_.assign(kMinSlots, Slot{0, kEmpty});
    mask_ = kMinSlots - 1;
    size_ = 0;
  }

 private:
  struct Slot {
    uint32_t tag;   // 4 bytes of the hash beside those that pick the home slot
    int32_t block;  // kEmpty: a free slot
  };
  static constexpr int32_t kEmpty = -1;
  static constexpr size_t kMinSlots = 1024;

  // A SHA-256 digest is uniform already: its bytes are the hash.
  size_t home(const Hash32& h) const {
    uint64_t v;
    std::memcpy(&v, h.b, sizeof v);
    return static_cast<size_t>(v) & mask_;
  }
  static uint32_t tag(const Hash32& h) {
    uint32_t v;
    std::memcpy(&v, h.b + 8, sizeof v);
    return v;
  }

  void grow(const Hash32* keys) {
    std::vector<Slot> old(2 * slots_.size(), Slot{0, kEmpty});
    old.swap(slots_);
    mask_ = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.block == kEmpty) continue;
      size_t i = home(keys[s.block]);
      while (slots_[i].block != kEmpty) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  size_t mask_;
  size_t size_ = 0;
};

}  // namespace enginecore
