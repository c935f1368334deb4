// torch's CPU wheel ships libgomp and runs its intra-op parallelism on it.
// Calling GOMP_parallel of that same copy (the one libtorch_cpu resolves,
// never loaded a second time) is what `#pragma omp parallel` inside torch
// does: the kernels run on the team torch's ops run on. Linking our own
// OpenMP would start a second pool that fights torch's spinning workers for
// the cores.
#include "cpu_threads.h"

#include <atomic>
#include <mutex>

#if defined(__linux__)
#include <dlfcn.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "loaded_library.h"

namespace enginecore {
namespace {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

using OmpGetThreadNum = int (*)();

struct OpenMP {
  GompParallel parallel = nullptr;
  OmpGetThreadNum thread_num = nullptr;
  std::string path;
};

const OpenMP& openmp() {
  static std::once_flag once;
  static OpenMP omp;
  std::call_once(once, [] {
#if defined(__linux__)
    // The GOMP_parallel torch itself binds to: looked up through libtorch_cpu's
    // handle (its dependencies, in load order), since another package may have
    // loaded a libgomp of its own (scikit-learn ships one) before or after it.
    std::string path;
    void* handle = find_loaded_library("libtorch_cpu", &path);
    if (handle == nullptr) handle = find_loaded_library("libgomp", &path);
    if (handle == nullptr) return;
    omp.parallel = reinterpret_cast<GompParallel>(dlsym(handle, "GOMP_parallel"));
    omp.thread_num = reinterpret_cast<OmpGetThreadNum>(dlsym(handle, "omp_get_thread_num"));
    Dl_info info;
    if (omp.parallel != nullptr && dladdr(reinterpret_cast<void*>(omp.parallel), &info) != 0 &&
        info.dli_fname != nullptr) {
      omp.path = info.dli_fname;
    } else {
      omp.parallel = nullptr;
    }
#endif
  });
  return omp;
}

struct Job {
  void (*fn)(void*, int64_t);
  void* ctx;
  int64_t n;
  std::atomic<int64_t> next{0};
};

void run_team_member(void* data) {
  auto* job = static_cast<Job*>(data);
  for (int64_t i = job->next.fetch_add(1, std::memory_order_relaxed); i < job->n;
       i = job->next.fetch_add(1, std::memory_order_relaxed)) {
    job->fn(job->ctx, i);
  }
}

}  // namespace

void parallel_for(int64_t n, int num_threads, void (*fn)(void*, int64_t), void* ctx) {
  if (n <= 0) return;
  const OpenMP& omp = openmp();
  if (num_threads <= 1 || n == 1 || omp.parallel == nullptr) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  Job job{fn, ctx, n};
  unsigned threads = static_cast<unsigned>(num_threads < n ? num_threads : n);
  omp.parallel(run_team_member, &job, threads, 0);
}

std::string openmp_runtime_path() { return openmp().path; }

namespace {

struct BindJob {
  const std::vector<int>* cpus;
  std::vector<int64_t>* tids;
  OmpGetThreadNum thread_num;
};

void bind_team_member(void* data) {
  auto* job = static_cast<BindJob*>(data);
  const int t = job->thread_num();
  if (t < 0 || t >= static_cast<int>(job->cpus->size())) return;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((*job->cpus)[t], &set);
  // pid 0: the calling thread only (Linux's per-thread affinity).
  if (sched_setaffinity(0, sizeof(set), &set) == 0) {
    (*job->tids)[t] = static_cast<int64_t>(syscall(SYS_gettid));
  }
#endif
}

}  // namespace

std::vector<int64_t> bind_team(const std::vector<int>& cpus) {
  std::vector<int64_t> tids(cpus.size(), -1);
  const OpenMP& omp = openmp();
  if (cpus.empty() || omp.parallel == nullptr || omp.thread_num == nullptr) return tids;
  BindJob job{&cpus, &tids, omp.thread_num};
  omp.parallel(bind_team_member, &job, static_cast<unsigned>(cpus.size()), 0);
  return tids;
}

}  // namespace enginecore
