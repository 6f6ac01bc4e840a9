// Work items 0..count-1 of one FFI call, handed out one at a time from a shared counter to the
// calling thread and to helpers on XLA's own intra-op thread pool (so nothing oversubscribes the
// cores XLA's other work uses). It returns once every handed-out item is done; a helper that starts
// late finds no work left and touches nothing but the shared counters.
//
// A worker taking two arguments, (item, next), is told the item its thread does next (-1: none):
// each thread claims its next item before it starts the current one, so the worker can prefetch
// the next item's data while it computes.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// make_worker() runs once on each thread that takes part and returns that thread's worker, a
// callable taking an item index, or an item index and the next one (it may own the thread's
// scratch). It must capture by value.
template <typename MakeWorker>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, MakeWorker make_worker) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> busy{0};  // helpers that may still hold an item
  };
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, count, make_worker] {
    auto work = make_worker();
    if constexpr (std::is_invocable_v<decltype(work)&, int64_t, int64_t>) {
      for (int64_t item = shared->next.fetch_add(1); item < count;) {
        const int64_t next = shared->next.fetch_add(1);
        work(item, next < count ? next : -1);
        item = next;
      }
    } else {
      for (int64_t item; (item = shared->next.fetch_add(1)) < count;) work(item);
    }
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
