// kaiten_cpu::shm_all_reduce_: the sum of a tensor over the ranks of a tensor-parallel engine
// (processes on one host), in place, through a shared-memory region every rank has mapped, as
// vLLM's CPU build reduces (csrc/cpu/shm.cpp). No socket, no syscall on the way: each rank copies
// its tensor into its own slot, publishes a counter, spins until every rank has published the
// same one, then sums the slots in rank order, so every rank holds the same bits afterwards.
// Two slots a rank, used in turn: a rank writes a slot again only two calls later, after every
// rank has arrived at the call between, i.e. has finished reading it. One barrier a call.
//
// Region layout (engine_worker/model/tp_comm.py allocates it): a 64-byte line per rank with its
// arrival counter, a line with the abort flag (set when a rank died: waiters throw rather than
// spin for ever; each rank's line also holds its pid, checked while it is waited on), then world x 2 slots of slot_bytes each.
#include "aten_ops.h"

#include <sched.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kSpinsBetweenYields = 2048;
constexpr int64_t kLivenessCheckNs = 100'000'000;   // a rank waited on this long is checked for life

struct Comm {
  char* base = nullptr;
  int64_t rank = 0, world = 1, slot_bytes = 0;
  uint64_t gen = 0;                 // calls made (chunks of a call count one each)
  int64_t calls = 0, ns_total = 0, ns_wait = 0;

  std::atomic<uint64_t>* counter(int64_t r) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + r * kLine);
  }
  std::atomic<uint64_t>* abort_flag() const { return counter(world); }
  std::atomic<int64_t>* pid(int64_t r) const { return reinterpret_cast<std::atomic<int64_t>*>(base + r * kLine + 8); }
  char* slot(int64_t r, uint64_t g) const {
    return base + (world + 1) * kLine + (r * 2 + static_cast<int64_t>(g & 1)) * slot_bytes;
  }
};

std::mutex registry_mutex;
std::unordered_map<int64_t, Comm> registry;   // by handle; a process holds a few at most

Comm& comm_of(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(handle);
  TORCH_CHECK(it != registry.end(), "shm_all_reduce_: no communicator ", handle, " attached in this process");
  return it->second;
}

// Whether process `pid` is gone or a zombie (dead, not yet reaped by its parent).
bool dead(int64_t pid) {
  if (pid <= 0) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;
  char state = '?';
  const int got = std::fscanf(f, "%*d (%*[^)]) %c", &state);
  std::fclose(f);
  return got == 1 && (state == 'Z' || state == 'X');
}

void wait_for_all(const Comm& c, uint64_t gen) {
  for (int64_t r = 0; r < c.world; ++r) {
    int64_t spins = 0;
    auto next_check = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kLivenessCheckNs);
    while (c.counter(r)->load(std::memory_order_acquire) < gen) {
      if (++spins % kSpinsBetweenYields == 0) {
        // a busy host: give the core to the rank we wait for; a dead rank: stop waiting
        TORCH_CHECK(c.abort_flag()->load(std::memory_order_relaxed) == 0,
                    "tensor-parallel all-reduce aborted: a rank of this engine died");
        const auto now = std::chrono::steady_clock::now();
        if (now > next_check) {
          next_check = now + std::chrono::nanoseconds(kLivenessCheckNs);
          TORCH_CHECK(!dead(c.pid(r)->load(std::memory_order_relaxed)),
                      "tensor-parallel all-reduce aborted: rank ", r, " of this engine died");
        }
        sched_yield();
      } else {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
  }
}

template <typename T>
void sum_slots(const Comm& c, uint64_t gen, T* out, int64_t n) {
  // fp32 sums for 16-bit types, rounded once; rank order, so every rank's bits are the same
  for (int64_t i = 0; i < n; ++i) {
    float acc = static_cast<float>(reinterpret_cast<const T*>(c.slot(0, gen))[i]);
    for (int64_t r = 1; r < c.world; ++r) acc += static_cast<float>(reinterpret_cast<const T*>(c.slot(r, gen))[i]);
    out[i] = static_cast<T>(acc);
  }
}

template <>
void sum_slots<float>(const Comm& c, uint64_t gen, float* out, int64_t n) {
  const float* first = reinterpret_cast<const float*>(c.slot(0, gen));
  std::memcpy(out, first, n * sizeof(float));
  for (int64_t r = 1; r < c.world; ++r) {
    const float* __restrict__ other = reinterpret_cast<const float*>(c.slot(r, gen));
    float* __restrict__ dst = out;
    for (int64_t i = 0; i < n; ++i) dst[i] += other[i];
  }
}

void shm_all_reduce_(at::Tensor x, int64_t handle) {
  Comm& c = comm_of(handle);
  const auto start = std::chrono::steady_clock::now();
  int64_t waited = 0;
  at::Tensor work = x.is_contiguous() ? x : x.contiguous();
  const int64_t elem = work.element_size();
  const int64_t per_chunk = c.slot_bytes / elem;
  char* data = static_cast<char*>(work.data_ptr());
  for (int64_t first = 0; first < work.numel(); first += per_chunk) {
    const int64_t n = std::min(per_chunk, work.numel() - first);
    const uint64_t gen = ++c.gen;
    std::memcpy(c.slot(c.rank, gen), data + first * elem, n * elem);
    c.counter(c.rank)->store(gen, std::memory_order_release);
    const auto before = std::chrono::steady_clock::now();
    wait_for_all(c, gen);
    waited += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - before).count();
    char* dst = data + first * elem;
    switch (work.scalar_type()) {
      case at::kFloat: sum_slots<float>(c, gen, reinterpret_cast<float*>(dst), n); break;
      case at::kBFloat16: sum_slots<c10::BFloat16>(c, gen, reinterpret_cast<c10::BFloat16*>(dst), n); break;
      case at::kHalf: sum_slots<c10::Half>(c, gen, reinterpret_cast<c10::Half*>(dst), n); break;
      default: TORCH_CHECK(false, "shm_all_reduce_: unsupported dtype ", work.scalar_type());
    }
  }
  if (!work.is_same(x)) x.copy_(work);
  c.calls += 1;
  c.ns_wait += waited;
  c.ns_total += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// Attach this process to a region (its address in this process, its size in bytes) as `rank` of
// `world`, under `handle`. The counters start at 0 in a fresh region (ftruncate zero-fills).
void shm_comm_attach(int64_t handle, int64_t address, int64_t bytes, int64_t rank, int64_t world) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "shm_comm_attach: rank ", rank, " of ", world);
  Comm c;
  c.base = reinterpret_cast<char*>(address);
  c.rank = rank;
  c.world = world;
  c.slot_bytes = ((bytes - (world + 1) * kLine) / (2 * world)) / kLine * kLine;
  TORCH_CHECK(c.slot_bytes >= kLine, "shm_comm_attach: a region of ", bytes, " bytes is too small");
  c.pid(rank)->store(getpid(), std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry[handle] = c;
}

// Set the region's abort flag: every rank waiting in (or entering) an all-reduce throws.
void shm_comm_abort(int64_t handle) { comm_of(handle).abort_flag()->store(1, std::memory_order_relaxed); }

// [calls, ns in the op, ns of them waiting for the other ranks] since attach, for the benchmark.
std::vector<int64_t> shm_comm_stats(int64_t handle) {
  const Comm& c = comm_of(handle);
  return {c.calls, c.ns_total, c.ns_wait};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("shm_all_reduce_(Tensor(a!) x, int handle) -> ()");
  m.def("shm_comm_attach(int handle, int address, int bytes, int rank, int world) -> ()", &shm_comm_attach);
  m.def("shm_comm_abort(int handle) -> ()", &shm_comm_abort);
  m.def("shm_comm_stats(int handle) -> int[]", &shm_comm_stats);
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("shm_all_reduce_", &shm_all_reduce_); }
