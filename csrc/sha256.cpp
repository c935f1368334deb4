// SHA-256 compression: portable C++ and an SHA-NI version (x86-64), same digests.
#include "sha256.h"

#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define ENGINECORE_X86 1
#endif

namespace enginecore {
namespace {

alignas(16) constexpr uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

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
#define ENGINECORE_SHANI __attribute__((target("sha,sse4.1,ssse3")))

// Byte order of each 32-bit lane reversed: big-endian message words <-> bytes.
ENGINECORE_SHANI inline __m128i bswap_mask() {
  return _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
}

// One 64-byte block on the (ABEF, CDGH) state, message words W0-15 in m0-m3
// (lane i of m_j is W[4j+i]). The SHA-NI round structure: 16 groups of 4
// rounds; message words are extended with sha256msg1/msg2 a group ahead of use.
ENGINECORE_SHANI __attribute__((always_inline)) inline void shani_block(
    __m128i& state0, __m128i& state1, __m128i m0, __m128i m1, __m128i m2, __m128i m3) {
  const __m128i abef = state0, cdgh = state1;
  __m128i m[4] = {m0, m1, m2, m3};
#pragma GCC unroll 16
  for (int g = 0; g < 16; ++g) {
    __m128i msg = _mm_add_epi32(m[g & 3],
                                _mm_load_si128(reinterpret_cast<const __m128i*>(&K[4 * g])));
    state1 = _mm_sha256rnds2_epu32(state1, state0, msg);
    if (g >= 3 && g < 15) {
      __m128i t = _mm_alignr_epi8(m[g & 3], m[(g - 1) & 3], 4);
      m[(g + 1) & 3] = _mm_sha256msg2_epu32(_mm_add_epi32(m[(g + 1) & 3], t), m[g & 3]);
    }
    msg = _mm_shuffle_epi32(msg, 0x0E);
    state0 = _mm_sha256rnds2_epu32(state0, state1, msg);
    if (g >= 1 && g < 13) {
      m[(g - 1) & 3] = _mm_sha256msg1_epu32(m[(g - 1) & 3], m[g & 3]);
    }
  }
  state0 = _mm_add_epi32(state0, abef);
  state1 = _mm_add_epi32(state1, cdgh);
}

ENGINECORE_SHANI inline __m128i load_words(const uint8_t* p) {
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), bswap_mask());
}

// (A..D, E..H) in lane order <-> the (ABEF, CDGH) layout sha256rnds2 works on.
ENGINECORE_SHANI inline void to_shani(__m128i abcd, __m128i efgh, __m128i& s0, __m128i& s1) {
  const __m128i tmp = _mm_shuffle_epi32(abcd, 0xB1);  // CDAB
  efgh = _mm_shuffle_epi32(efgh, 0x1B);               // EFGH
  s0 = _mm_alignr_epi8(tmp, efgh, 8);                 // ABEF
  s1 = _mm_blend_epi16(efgh, tmp, 0xF0);              // CDGH
}

ENGINECORE_SHANI inline void from_shani(__m128i s0, __m128i s1, __m128i& abcd, __m128i& efgh) {
  const __m128i tmp = _mm_shuffle_epi32(s0, 0x1B);  // FEBA
  s1 = _mm_shuffle_epi32(s1, 0xB1);                 // DCHG
  abcd = _mm_blend_epi16(tmp, s1, 0xF0);            // DCBA
  efgh = _mm_alignr_epi8(s1, tmp, 8);               // HGFE
}

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
