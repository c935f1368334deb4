// SHA-256 compression (FIPS 180-4): SHA-NI when the CPU has it, chosen at run
// time by CPUID, and a portable version that gives the same digests.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace enginecore {

constexpr uint32_t kSha256Init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

using Sha256CompressFn = void (*)(uint32_t state[8], const uint8_t* data, size_t nblocks);

// The compression function for this CPU (decided once).
Sha256CompressFn sha256_compress();
// Whether that is the SHA-NI one (block_hash.cpp then runs its own chain on
// the rounds of sha256_shani.h).
bool sha256_uses_shani();
// Which one it is: "sha-ni" or "portable".
const char* sha256_impl_name();
// Force the portable implementation (tests compare both).
void sha256_force_portable(bool force);

// One-shot SHA-256 of a message of any length.
void sha256(const uint8_t* data, size_t len, uint8_t out[32]);

// SHA-256(parent || data) for a short message (32 + len <= kShortMessage bytes):
// one chain step with nothing allocated (the decode step hashes a block per
// request whose last token filled one).
constexpr size_t kShortMessage = 512;
void sha256_after(const uint8_t parent[32], const uint8_t* data, size_t len, uint8_t out[32]);

// A chain of messages hashed one at a time: digest[b] = SHA-256(digest[b-1] ||
// varying[b] || suffix), digest[-1] = parent. One step at a time so callers can
// interleave their own work (reading the next block's token ids): the chain is
// latency-bound, and the CPU overlaps that work with it.
class Sha256Chain {
 public:
  Sha256Chain(const uint8_t parent[32], size_t varying_len, const uint8_t* suffix,
              size_t suffix_len);
  // The next digest into `out` (32 bytes), which must stay put until the next
  // call: it is read back as the next message's first 32 bytes.
  void next(const uint8_t* varying, uint8_t out[32]);

 private:
  std::vector<uint8_t> msg_;  // the message: parent slot, varying, suffix, padding
  size_t varying_len_;
  size_t nblocks_;
  const uint8_t* prev_;
  Sha256CompressFn compress_;
};

}  // namespace enginecore
