// The CPU model kernels compiled three times (AVX-512, AVX2+FMA, baseline)
// from cpu_kernels_impl.h, and the choice among them by CPUID at first use,
// so one build runs everywhere and vectorizes for the machine it runs on.
#include "cpu_kernels.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <algorithm>
#include <utility>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#endif

namespace enginecore {

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define ENGINECORE_MULTI_ISA 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
// Only here: the decode attention on AVX-512 registers (attention_decode_avx512.h).
#define ECK_AVX512_DECODE 1
namespace isa_avx512 {
#include "cpu_kernels_impl.h"
#include "cpu_kernels_argmax_impl.h"
#include "cpu_kernels_sample_impl.h"
#include "cpu_kernels_logprobs_impl.h"
}  // namespace isa_avx512
#undef ECK_AVX512_DECODE
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#include "cpu_kernels_impl.h"
#include "cpu_kernels_argmax_impl.h"
#include "cpu_kernels_sample_impl.h"
#include "cpu_kernels_logprobs_impl.h"
}  // namespace isa_avx2
#pragma GCC pop_options
#endif

namespace isa_baseline {
#include "cpu_kernels_impl.h"
#include "cpu_kernels_argmax_impl.h"
#include "cpu_kernels_sample_impl.h"
#include "cpu_kernels_logprobs_impl.h"
}  // namespace isa_baseline

namespace {

#define ECK_TABLE(name, ns) \
  CpuKernels {                                                                         \
    name, ns::attend_items, ns::rms_norm, ns::rope, ns::silu_and_mul, ns::argmax_rows, \
        ns::sample_rows, ns::top_p_rows, ns::logprob_rows                               \
  }

// ENGINECORE_CPU_ISA=avx2 / baseline caps the choice (the tests of an AVX-512 machine
// then run the other variants too); unset, or a variant this CPU lacks: the best one.
bool allowed(const char* isa) {
  const char* cap = std::getenv("ENGINECORE_CPU_ISA");
  if (cap == nullptr || *cap == '\0' || std::strcmp(cap, "avx512") == 0) return true;
  if (std::strcmp(cap, "avx2") == 0) return std::strcmp(isa, "avx512") != 0;
  if (std::strcmp(cap, "baseline") == 0) return std::strcmp(isa, "baseline") == 0;
  return true;  // unknown: ignored (cpu_kernels_info()["isa"] says what runs)
}

CpuKernels choose() {
#ifdef ENGINECORE_MULTI_ISA
  __builtin_cpu_init();
  if (allowed("avx512") && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return ECK_TABLE("avx512", isa_avx512);
  }
  if (allowed("avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return ECK_TABLE("avx2", isa_avx2);
  }
#endif
  return ECK_TABLE("baseline", isa_baseline);
}

}  // namespace

const CpuKernels& cpu_kernels() {
  static const CpuKernels k = choose();
  return k;
}

}  // namespace enginecore
