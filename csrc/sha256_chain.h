// A prefix-cache hash chain on SHA-NI that reads its input between its rounds:
// digest[b] = SHA-256(digest[b-1] || ids of block b (uint32 LE) || suffix).
// Used by block_hash.cpp (ids from a Python list) and the request table (a
// prompt's ids copied into its row while they are hashed).
#pragma once
#include <algorithm>
#include <cstring>
#include <vector>

#include "sha256.h"
#include "sha256_shani.h"

namespace enginecore {

#ifdef ENGINECORE_X86
// The chain is latency-bound (each message starts from the last digest), so the
// core has room beside it, but only for work in the reorder window next to the
// rounds: block b+1's ids are read between block b's groups of rounds (read
// between whole blocks, they were mostly serial work: ~25 % over openssl's rate
// for 32k ids from a Python list). `read_id(b, i, out)` gives id i of block b
// and must make no call (a call spills the SHA state: every xmm register is
// caller-saved); false means that id wants the caller's general path: the
// chain stops after the block before it. `digest_out(b)` says where block b's
// digest goes (called before its rounds; it may allocate). The digest stays in
// registers as the next message's first words. Returns the blocks hashed;
// `last` gets the last digest (`parent` if none).
template <class ReadId, class DigestOut>
ENGINECORE_SHANI size_t sha256_chain_reading(size_t num_blocks, size_t block_size,
                                             const uint8_t parent[32], const uint8_t* suffix,
                                             size_t suffix_len, ReadId&& read_id,
                                             DigestOut&& digest_out, uint8_t last[32]) {
  using namespace sha256_detail;  // NOLINT: the SHA-NI rounds
  std::memcpy(last, parent, 32);
  if (num_blocks == 0 || block_size == 0) return 0;
  // The message from byte 32 on: ids, suffix, padding, length. Two of them: the
  // next block's ids are read into one while the other is hashed (no copy
  // between blocks: a memcpy call there spilled the digest across it).
  const size_t msg_len = 32 + 4 * block_size + suffix_len;
  const size_t nblocks = (msg_len + 9 + 63) / 64;
  const size_t body_len = nblocks * 64 - 32;
  std::vector<uint32_t> bodies((2 * body_len + 3) / 4, 0);  // 4-byte aligned ids
  uint8_t* body[2] = {reinterpret_cast<uint8_t*>(bodies.data()),
                      reinterpret_cast<uint8_t*>(bodies.data()) + body_len};
  for (uint8_t* m : body) {
    if (suffix_len) std::memcpy(m + 4 * block_size, suffix, suffix_len);
    m[msg_len - 32] = 0x80;
    const uint64_t bits = uint64_t(msg_len) * 8;
    for (int i = 0; i < 8; ++i) m[body_len - 1 - i] = uint8_t(bits >> (8 * i));
  }
  // After group g (16 per compression) the next block's first upto[g] ids are read.
  const size_t groups = 16 * nblocks;
  std::vector<size_t> upto(groups);
  for (size_t g = 0; g < groups; ++g) upto[g] = (g + 1) * block_size / groups;
  uint32_t* ids[2] = {reinterpret_cast<uint32_t*>(body[0]), reinterpret_cast<uint32_t*>(body[1])};
  int cur = 0;
  bool ok = true;
  for (size_t i = 0; i < block_size; ++i) ok = read_id(size_t(0), i, ids[0][i]) && ok;
  if (!ok) return 0;
  __m128i w0 = load_words(parent), w1 = load_words(parent + 16);
  const __m128i iv0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&kSha256Init[0]));
  const __m128i iv1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&kSha256Init[4]));
  size_t b = 0;
  while (b < num_blocks) {
    uint8_t* d = digest_out(b);
    const size_t ahead_n = b + 1 < num_blocks ? block_size : 0;
    size_t read = 0;
    uint32_t* ahead = ids[cur ^ 1];
    auto work_at = [&](size_t g) {
      const size_t end = std::min(upto[g], ahead_n);
      for (; read < end; ++read) ok = read_id(b + 1, read, ahead[read]) && ok;
    };
    __m128i s0, s1;
    to_shani(iv0, iv1, s0, s1);
    const uint8_t* p = body[cur];
    shani_block(s0, s1, w0, w1, load_words(p), load_words(p + 16),
                [&](int g) { work_at(size_t(g)); });
    for (size_t k = 1; k < nblocks; ++k) {
      p = body[cur] + 64 * k - 32;
      shani_block(s0, s1, load_words(p), load_words(p + 16), load_words(p + 32),
                  load_words(p + 48), [&](int g) { work_at(16 * k + size_t(g)); });
    }
    from_shani(s0, s1, w0, w1);  // the digest's words: the next message's W0-7
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_shuffle_epi8(w0, bswap_mask()));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), _mm_shuffle_epi8(w1, bswap_mask()));
    std::memcpy(last, d, 32);
    ++b;
    if (!ok) break;  // the next block's ids want the general path
    cur ^= 1;
  }
  return b;
}
#endif  // ENGINECORE_X86

}  // namespace enginecore
