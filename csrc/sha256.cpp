// SHA-256 compression: portable C++ and an SHA-NI version (x86-64), same digests.
#include "sha256.h"

#include <cstring>
#include <vector>

#include "sha256_shani.h"

#ifdef ENGINECORE_X86
#include <cpuid.h>
#endif

namespace enginecore {
namespace {

using namespace sha256_detail;  // NOLINT: K and the SHA-NI rounds

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress_portable(uint32_t state[8], const uint8_t* data, size_t nblocks) {
  uint32_t w[64];
  while (nblocks--) {
    for (int i = 0; i < 16; ++i) {
      const uint8_t* p = data + 4 * i;
      w[i] = (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
    }
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
      uint32_t ch = (e & f) ^ (~e & g);
      uint32_t t1 = h + S1 + ch + K[i] + w[i];
      uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
      uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
      uint32_t t2 = S0 + maj;
      h = g; g = f; f = e; e = d + t1;
      d = c; c = b; b = a; a = t1 + t2;
    }
    state[0] += a; state[1] += b; state[2] += c; state[3] += d;
    state[4] += e; state[5] += f; state[6] += g; state[7] += h;
    data += 64;
  }
}

#ifdef ENGINECORE_X86
ENGINECORE_SHANI void compress_shani(uint32_t state[8], const uint8_t* data, size_t nblocks) {
  __m128i state0, state1;
  to_shani(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&state[0])),
           _mm_loadu_si128(reinterpret_cast<const __m128i*>(&state[4])), state0, state1);
  for (; nblocks--; data += 64) {
    shani_block(state0, state1, load_words(data), load_words(data + 16), load_words(data + 32),
                load_words(data + 48));
  }
  __m128i abcd, efgh;
  from_shani(state0, state1, abcd, efgh);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(&state[0]), abcd);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(&state[4]), efgh);
}

// One message of a chain: W0-7 are the previous digest's words, W8 on come
// from `body` (the message from byte 32: varying part, suffix, padding, length).
// The previous digest is read back from where the last step stored it, with
// 16-byte loads of 16-byte stores so the store forwards.
ENGINECORE_SHANI void chain_step_shani(const uint8_t prev[32], const uint8_t* body,
                                       size_t nblocks, uint8_t out[32]) {
  __m128i state0, state1;
  to_shani(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&kSha256Init[0])),
           _mm_loadu_si128(reinterpret_cast<const __m128i*>(&kSha256Init[4])), state0, state1);
  shani_block(state0, state1, load_words(prev), load_words(prev + 16), load_words(body),
              load_words(body + 16));
  for (size_t k = 1; k < nblocks; ++k) {
    const uint8_t* p = body + 64 * k - 32;
    shani_block(state0, state1, load_words(p), load_words(p + 16), load_words(p + 32),
                load_words(p + 48));
  }
  __m128i abcd, efgh;
  from_shani(state0, state1, abcd, efgh);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_shuffle_epi8(abcd, bswap_mask()));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_shuffle_epi8(efgh, bswap_mask()));
}

bool cpu_has_sha_ni() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool ssse3 = c & (1u << 9), sse41 = c & (1u << 19);
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool sha = b & (1u << 29);
  return sha && ssse3 && sse41;
}
#endif

bool g_force_portable = false;

Sha256CompressFn detect() {
#ifdef ENGINECORE_X86
  if (cpu_has_sha_ni()) return compress_shani;
#endif
  return compress_portable;
}

const Sha256CompressFn g_best = detect();

}  // namespace

Sha256CompressFn sha256_compress() { return g_force_portable ? compress_portable : g_best; }

Sha256Chain::Sha256Chain(const uint8_t parent[32], size_t varying_len, const uint8_t* suffix,
                         size_t suffix_len)
    : varying_len_(varying_len), compress_(sha256_compress()) {
  const size_t msg_len = 32 + varying_len + suffix_len;
  nblocks_ = (msg_len + 9 + 63) / 64;
  msg_.assign(nblocks_ * 64, 0);
  std::memcpy(msg_.data(), parent, 32);
  if (suffix_len) std::memcpy(msg_.data() + 32 + varying_len, suffix, suffix_len);
  msg_[msg_len] = 0x80;
  const uint64_t bits = uint64_t(msg_len) * 8;
  for (int i = 0; i < 8; ++i) msg_[nblocks_ * 64 - 1 - i] = uint8_t(bits >> (8 * i));
  prev_ = msg_.data();
}

void Sha256Chain::next(const uint8_t* varying, uint8_t out[32]) {
  std::memcpy(msg_.data() + 32, varying, varying_len_);
#ifdef ENGINECORE_X86
  if (compress_ == compress_shani) {
    chain_step_shani(prev_, msg_.data() + 32, nblocks_, out);
    prev_ = out;
    return;
  }
#endif
  std::memcpy(msg_.data(), prev_, 32);
  uint32_t state[8];
  std::memcpy(state, kSha256Init, sizeof(state));
  compress_(state, msg_.data(), nblocks_);
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = uint8_t(state[i] >> 24);
    out[4 * i + 1] = uint8_t(state[i] >> 16);
    out[4 * i + 2] = uint8_t(state[i] >> 8);
    out[4 * i + 3] = uint8_t(state[i]);
  }
  prev_ = out;
}

void sha256_after(const uint8_t parent[32], const uint8_t* data, size_t len, uint8_t out[32]) {
  const size_t msg_len = 32 + len;
  if (msg_len > kShortMessage) {
    std::vector<uint8_t> msg(parent, parent + 32);
    msg.insert(msg.end(), data, data + len);
    sha256(msg.data(), msg.size(), out);
    return;
  }
  // The message padded, parent first: [parent | data | 0x80 0... | length].
  alignas(16) uint8_t msg[kShortMessage + 64];
  const size_t nblocks = (msg_len + 9 + 63) / 64;
  std::memcpy(msg, parent, 32);
  std::memcpy(msg + 32, data, len);
  std::memset(msg + msg_len, 0, nblocks * 64 - msg_len);
  msg[msg_len] = 0x80;
  const uint64_t bits = uint64_t(msg_len) * 8;
  for (int i = 0; i < 8; ++i) msg[nblocks * 64 - 1 - i] = uint8_t(bits >> (8 * i));
#ifdef ENGINECORE_X86
  if (sha256_compress() == compress_shani) {
    chain_step_shani(parent, msg + 32, nblocks, out);
    return;
  }
#endif
  uint32_t state[8];
  std::memcpy(state, kSha256Init, sizeof(state));
  sha256_compress()(state, msg, nblocks);
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = uint8_t(state[i] >> 24);
    out[4 * i + 1] = uint8_t(state[i] >> 16);
    out[4 * i + 2] = uint8_t(state[i] >> 8);
    out[4 * i + 3] = uint8_t(state[i]);
  }
}

bool sha256_uses_shani() {
#ifdef ENGINECORE_X86
  return sha256_compress() == compress_shani;
#else
  return false;
#endif
}

const char* sha256_impl_name() {
  return sha256_compress() == compress_portable ? "portable" : "sha-ni";
}

void sha256_force_portable(bool force) { g_force_portable = force; }

void sha256(const uint8_t* data, size_t len, uint8_t out[32]) {
  uint32_t state[8];
  std::memcpy(state, kSha256Init, sizeof(state));
  const size_t full = len / 64;
  Sha256CompressFn fn = sha256_compress();
  fn(state, data, full);
  uint8_t tail[128] = {0};
  const size_t rest = len - full * 64;
  std::memcpy(tail, data + full * 64, rest);
  tail[rest] = 0x80;
  const size_t tail_blocks = rest + 9 <= 64 ? 1 : 2;
  const uint64_t bits = uint64_t(len) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_blocks * 64 - 1 - i] = uint8_t(bits >> (8 * i));
  fn(state, tail, tail_blocks);
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = uint8_t(state[i] >> 24);
    out[4 * i + 1] = uint8_t(state[i] >> 16);
    out[4 * i + 2] = uint8_t(state[i] >> 8);
    out[4 * i + 3] = uint8_t(state[i]);
  }
}

}  // namespace enginecore
