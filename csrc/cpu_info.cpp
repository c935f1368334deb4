// What the CPU offers and what the kernels picked (cpu_kernels_info), and the
// binding of torch's OpenMP team to cores (bind_openmp_threads <->
// python/enginecore/executor/cpu_threads.py bind_openmp_threads_py).
//
// AMX: reported (CPUID, the OS's XSAVE state, Linux's per-process permission)
// but no kernel uses it: an AMX tile path could not be verified on the machines
// this was built on, and an unverified kernel is not shipped.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_kernels.h"
#include "cpu_threads.h"

namespace py = pybind11;

namespace enginecore {

const char* bf16_linear_isa();  // bf16_gemm.cpp
bool bf16_gemv_available();     // bf16_gemv.cpp

namespace {

struct CpuFeatures {
  bool avx2 = false, avx512f = false, avx512_bf16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_os = false;
};

CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = (b >> 5) & 1;
    f.avx512f = (b >> 16) & 1;
    f.amx_bf16 = (d >> 22) & 1;
    f.amx_tile = (d >> 24) & 1;
  }
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512_bf16 = (a >> 5) & 1;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (__get_cpuid(1, &a1, &b1, &c1, &d1) && ((c1 >> 27) & 1)) {  // OSXSAVE: xgetbv works
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    f.amx_os = ((lo >> 17) & 3) == 3;  // XTILECFG and XTILEDATA enabled in XCR0
  }
#endif
  return f;
}

// Linux >= 5.16 gives a process AMX's tile data state only on request
// (arch_prctl ARCH_REQ_XCOMP_PERM); this asks whether it holds it, without asking for it.
std::string amx_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr int kArchGetXcompPerm = 0x1022;
  constexpr int kXfeatureXtiledata = 18;
  uint64_t bits = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bits) != 0) return "unknown";
  return ((bits >> kXfeatureXtiledata) & 1) ? "granted" : "not requested";
#else
  return "n/a";
#endif
}

py::dict cpu_kernels_info() {
  const CpuFeatures f = cpu_features();
  py::dict d;
  d["isa"] = cpu_kernels().isa;
  d["openmp"] = openmp_runtime_path();
  d["avx2"] = f.avx2;
  d["avx512f"] = f.avx512f;
  d["avx512_bf16"] = f.avx512_bf16;
  d["amx"] = f.amx_tile && f.amx_bf16 && f.amx_os;
  d["amx_permission"] = amx_permission();
  // The bf16 GEMM model/linear.py runs where oneDNN has no bf16 path.
  d["bf16_linear"] = bf16_linear_isa();
  // The decode GEMV model/linear.py runs for 1-4 rows (bf16_gemv.cpp).
  d["bf16_gemv"] = bf16_gemv_available() ? "avx512_bf16" : "none";
  // Decode attention (attention_decode_avx512.h) where the AVX-512 kernels run.
  d["attention_decode"] = std::strcmp(cpu_kernels().isa, "avx512") == 0
                              ? "avx512 registers (head_dim 64 / 128, up to 8 rows per KV head)"
                              : "generic";
  d["amx_kernels"] = "none (no AMX kernel ships: none could be verified on an AMX machine)";
  // Times the kernels' OpenMP team was found starved (another process on its
  // cores) and ran the next calls on one thread (cpu_threads.cpp).
  d["starved_team_spells"] = starved_team_spells();
  return d;
}

std::vector<int64_t> bind_openmp_threads(const std::vector<int>& cpus) {
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) throw std::invalid_argument("CPU id out of range");
  }
  py::gil_scoped_release release;
  return bind_team(cpus);
}

std::vector<int64_t> team_thread_ids(int num_threads) {
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  py::gil_scoped_release release;
  return team_tids(num_threads);
}

}  // namespace

void bind_cpu_info(py::module_& m) {
  m.def("cpu_kernels_info", &cpu_kernels_info,
        "The instruction set the CPU model kernels run with, the OpenMP runtime (torch's) "
        "they split work on ('' = serial), and the CPU's AVX2 / AVX-512 / AMX features.");
  m.def("team_thread_ids", &team_thread_ids, py::arg("num_threads"),
        "The Linux thread id of each member of torch's OpenMP team of num_threads threads "
        "(member 0 is the calling thread); -1 where unknown.");
  m.def("bind_openmp_threads", &bind_openmp_threads, py::arg("cpus"),
        "Bind thread i of torch's OpenMP team of len(cpus) threads to cpus[i]; returns each "
        "thread's tid (-1: not bound).");
}

}  // namespace enginecore
