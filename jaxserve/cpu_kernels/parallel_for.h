// Work items 0..count-1 of one FFI call, handed out one at a time from a shared counter to the
// calling thread and to helpers on XLA's own intra-op thread pool (so nothing oversubscribes the
// cores XLA's other work uses). It returns once every handed-out item is done; a helper that starts
// late finds no work left and touches nothing but the shared counters.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// make_worker() runs once on each thread that takes part and returns that thread's worker, a
// callable taking an item index (it may own the thread's scratch). It must capture by value.
template <typename MakeWorker>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, MakeWorker make_worker) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> busy{0};  // helpers that may still hold an item
  };
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, count, make_worker] {
    auto work = make_worker();
    for (int64_t item; (item = shared->next.fetch_add(1)) < count;) work(item);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared, drain] {
      shared->busy.fetch_add(1);
      drain();
      shared->busy.fetch_sub(1);
    });
  }
  drain();
  while (shared->busy.load() > 0) std::this_thread::yield();
}

}  // namespace jaxserve
