// SHA-256 building blocks shared by sha256.cpp (the compression, the chain
// step) and block_hash.cpp (a chain that reads the next block's token ids
// between the rounds of this one): the round constants, and on x86-64 the
// SHA-NI rounds on the (ABEF, CDGH) state.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ENGINECORE_X86 1
#endif

namespace enginecore {
namespace sha256_detail {

alignas(16) inline constexpr uint32_t K[64] = {
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

#ifdef ENGINECORE_X86
#define ENGINECORE_SHANI __attribute__((target("sha,sse4.1,ssse3")))

// What runs between two groups of four rounds: nothing, or the caller's
// independent work (the chain is latency-bound; the CPU overlaps the two).
struct NoWork {
  void operator()(int) const {}
};

// Byte order of each 32-bit lane reversed: big-endian message words <-> bytes.
ENGINECORE_SHANI inline __m128i bswap_mask() {
  return _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
}

// One 64-byte block on the (ABEF, CDGH) state, message words W0-15 in m0-m3
// (lane i of m_j is W[4j+i]). The SHA-NI round structure: 16 groups of 4
// rounds; message words are extended with sha256msg1/msg2 a group ahead of use.
// `work(g)` runs after group g (0-15).
template <class Work = NoWork>
ENGINECORE_SHANI __attribute__((always_inline)) inline void shani_block(
    __m128i& state0, __m128i& state1, __m128i m0, __m128i m1, __m128i m2, __m128i m3,
    Work&& work = Work()) {
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
    work(g);
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
#endif  // ENGINECORE_X86

}  // namespace sha256_detail
}  // namespace enginecore
