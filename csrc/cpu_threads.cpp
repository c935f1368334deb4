// torch's CPU wheel ships libgomp and runs its intra-op parallelism on it.
// Calling GOMP_parallel of that same copy (the one libtorch_cpu resolves,
// never loaded a second time) is what `#pragma omp parallel` inside torch
// does: the kernels run on the team torch's ops run on. Linking our own
// OpenMP would start a second pool that fights torch's spinning workers for
// the cores.
#include "cpu_threads.h"

#include <atomic>
#include <chrono>
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

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Job {
  void (*fn)(void*, int64_t);
  void* ctx;
  int64_t n;
  std::atomic<int64_t> next{0};
  // When the first thread found no item left (ns): from then on the team only
  // waits for the others to finish theirs and reach the join barrier.
  std::atomic<int64_t> first_done{0};
};

void run_team_member(void* data) {
  auto* job = static_cast<Job*>(data);
  for (int64_t i = job->next.fetch_add(1, std::memory_order_relaxed); i < job->n;
       i = job->next.fetch_add(1, std::memory_order_relaxed)) {
    job->fn(job->ctx, i);
  }
  int64_t none = 0;
  job->first_done.compare_exchange_strong(none, now_ns(), std::memory_order_relaxed);
}

// Starved teams. With another process busy on a core, a team member waits for
// a time slice: the items are handed out dynamically, so the others do its
// share, but the join barrier still waits for it to wake (or to finish the
// item it was preempted in). Measured on a 2-core EPYC with one core busy:
// 0.21x of the idle decode rate with two threads (docs/benchmarks.md). So a
// region whose wait at the end is longer than its work (and over 50 us) is a
// strike; three in a row run the next kRunsSerial calls on the calling thread
// only, then the team is tried again. Items give the same bits on any thread,
// so results do not change; on an idle machine the members finish within an
// item of each other and no region strikes.
constexpr int kStrikesToSerial = 3;
constexpr int64_t kRunsSerial = 1000;
constexpr int64_t kMinWaitNs = 50'000;
std::atomic<int> g_strikes{0};
std::atomic<int64_t> g_serial_left{0};
std::atomic<int64_t> g_serial_spells{0};

bool team_starved() {
  int64_t left = g_serial_left.load(std::memory_order_relaxed);
  while (left > 0) {
    if (g_serial_left.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

void judge_team(int64_t start, int64_t first_done, int64_t end) {
  const int64_t wait = end - first_done, work = first_done - start;
  if (first_done == 0 || wait <= work || wait < kMinWaitNs) {
    g_strikes.store(0, std::memory_order_relaxed);
    return;
  }
  if (g_strikes.fetch_add(1, std::memory_order_relaxed) + 1 >= kStrikesToSerial) {
    g_strikes.store(0, std::memory_order_relaxed);
    g_serial_left.store(kRunsSerial, std::memory_order_relaxed);
    g_serial_spells.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace

void parallel_for(int64_t n, int num_threads, void (*fn)(void*, int64_t), void* ctx) {
  if (n <= 0) return;
  const OpenMP& omp = openmp();
  if (num_threads <= 1 || n == 1 || omp.parallel == nullptr || team_starved()) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  Job job{fn, ctx, n};
  unsigned threads = static_cast<unsigned>(num_threads < n ? num_threads : n);
  const int64_t start = now_ns();
  omp.parallel(run_team_member, &job, threads, 0);
  judge_team(start, job.first_done.load(std::memory_order_relaxed), now_ns());
}

int64_t starved_team_spells() { return g_serial_spells.load(std::memory_order_relaxed); }

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
  if (t < 0 || t >= static_cast<int>(job->tids->size())) return;
#if defined(__linux__)
  if (job->cpus == nullptr) {  // only asked who the member is
    (*job->tids)[t] = static_cast<int64_t>(syscall(SYS_gettid));
    return;
  }
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

std::vector<int64_t> team_tids(int num_threads) {
  std::vector<int64_t> tids(num_threads, -1);
  const OpenMP& omp = openmp();
  if (omp.parallel == nullptr || omp.thread_num == nullptr) {
#if defined(__linux__)
    tids[0] = static_cast<int64_t>(syscall(SYS_gettid));  // no team: the caller alone
#endif
    return tids;
  }
  BindJob job{nullptr, &tids, omp.thread_num};
  omp.parallel(bind_team_member, &job, static_cast<unsigned>(num_threads), 0);
  return tids;
}

}  // namespace enginecore
