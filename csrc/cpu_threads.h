// Work splitting for the CPU model kernels on torch's own OpenMP threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace enginecore {

// Runs fn(ctx, i) for every i in [0, n), spread over `num_threads` threads of
// the OpenMP runtime torch loaded (the same team torch's own ops use, so the
// kernels never compete with idle-spinning torch workers), items handed out
// one at a time from a shared counter. Serial when num_threads <= 1, n <= 1,
// or no OpenMP runtime is loaded. Call without the GIL; fn must not throw.
void parallel_for(int64_t n, int num_threads, void (*fn)(void* ctx, int64_t i), void* ctx);

// How many times parallel_for found its team starved (a member kept the others
// waiting at the join barrier longer than they worked: another process holds
// its core) and ran the next calls serially.
int64_t starved_team_spells();

// Path of the OpenMP runtime parallel_for uses, or "" when it runs serially.
std::string openmp_runtime_path();

// Binds thread i of a team of cpus.size() threads of that runtime to cpus[i]
// (libgomp reuses the same threads for every later team of that size, so the
// binding holds for torch's ops and our kernels once torch runs that many
// threads). Returns each thread's Linux tid, -1 where binding failed.
std::vector<int64_t> bind_team(const std::vector<int>& cpus);

// The Linux thread id of each member of a team of num_threads (-1: unknown).
std::vector<int64_t> team_tids(int num_threads);

}  // namespace enginecore
