// parallel_chunks(n, min_chunk, body): [0, n) shared by at::parallel_for's threads as one queue of
// shrinking chunks instead of an equal share each. body(queue) runs once on every thread (so its
// scratch is set up once) and takes chunks with queue.next(begin, end) until none is left. A chunk
// is 1 / (2 x threads) of what is left, never under min_chunk: the first ones are long runs of
// the weight, the last ones short, so a thread that is preempted (a 2-core server shares its cores
// with the gateway, Redis and the client) or woken late leaves its work to the others instead of
// holding every thread at the region's end. (The attention kernel's work items differ in cost, so it
// takes them one at a time from a counter of its own.)
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kaiten {

class ChunkQueue {
 public:
  ChunkQueue(int64_t n, int64_t min_chunk, int64_t threads)
      : n_(n), min_(std::max<int64_t>(1, min_chunk)), parts_(2 * std::max<int64_t>(1, threads)) {}

  // The next chunk [begin, end), or false when the range is taken.
  bool next(int64_t& begin, int64_t& end) {
    int64_t at = pos_.load(std::memory_order_relaxed);
    while (at < n_) {
      const int64_t stop = std::min(n_, at + std::max(min_, (n_ - at) / parts_));
      if (pos_.compare_exchange_weak(at, stop, std::memory_order_relaxed)) {
        begin = at;
        end = stop;
        return true;
      }
    }
    return false;
  }

 private:
  std::atomic<int64_t> pos_{0};
  const int64_t n_, min_, parts_;
};

template <typename Body>
void parallel_chunks(int64_t n, int64_t min_chunk, const Body& body) {
  if (n <= 0) return;
  const int64_t most = (n + std::max<int64_t>(1, min_chunk) - 1) / std::max<int64_t>(1, min_chunk);
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), most);
  ChunkQueue queue(n, min_chunk, threads);
  if (threads <= 1) return body(queue);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(queue); });
}

}  // namespace kaiten
