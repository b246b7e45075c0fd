// The thread pool: a call's chunks claimed by every thread, the caller's included.
#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace hotlora {
namespace {

// A spin-wait's hint to the core that this thread only waits.
inline void spin_pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  __asm__ __volatile__("yield");
#endif
}

// Threads for one call at a time. A call's work is cut into chunks that every thread, the
// caller's included, claims until none is left: a thread the OS has set aside for another
// process holds up only a chunk it has claimed, never the whole call. Between calls (a decode
// step makes hundreds, microseconds apart) the workers spin a little, yielding, then sleep.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; i++) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      state_.store(next_generation() << 32);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // task(c) for every c < chunks (at most 65535), on whichever threads claim them; returns when
  // all are done.
  void run(int chunks, const std::function<void(int)>& task) {
    if (workers_.empty() || chunks == 1) {
      for (int c = 0; c < chunks; c++) task(c);
      return;
    }
    task_ = &task;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = next_generation();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state_.store(generation << 32 | static_cast<uint64_t>(chunks) << 16,
                   std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    const int mine = work(generation);
    for (int spins = 1; done_.load(std::memory_order_acquire) + mine < chunks; spins++) {
      spin_pause();
      if (spins % 64 == 0) std::this_thread::yield();
    }
  }

 private:
  // state_: generation (32 bits) | chunks (16) | chunks claimed so far (16).
  uint64_t next_generation() const {
    return ((state_.load(std::memory_order_relaxed) >> 32) + 1) & 0xffffffffu;
  }

  // Claims and runs chunks of `generation` while any is left; returns how many it ran. A chunk
  // claimed is one the caller waits for, so task_ stays this generation's until it is done.
  int work(uint64_t generation) {
    int ran = 0;
    uint64_t s = state_.load(std::memory_order_acquire);
    while (s >> 32 == generation && (s & 0xffff) < (s >> 16 & 0xffff)) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
        (*task_)(static_cast<int>(s & 0xffff));
        ran++;
        s = state_.load(std::memory_order_acquire);
      }
    }
    return ran;
  }

  void loop() {
    uint64_t seen = 0;  // the generation a new pool starts at, even if this thread starts late
    const auto changed = [&] { return state_.load(std::memory_order_acquire) >> 32 != seen; };
    while (true) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; !changed(); spins++) {
        spin_pause();
        if (spins % 256 != 0) continue;
        if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(300)) {
          std::this_thread::yield();
          continue;
        }
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, changed);
        sleeping_.fetch_sub(1);
      }
      seen = state_.load(std::memory_order_acquire) >> 32;
      if (stop_.load()) return;
      if (const int ran = work(seen)) done_.fetch_add(ran, std::memory_order_release);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* task_ = nullptr;
};

// The threads of every product; set_threads replaces them between products.
std::mutex g_pool_mutex;
std::unique_ptr<Pool> g_pool;

}  // namespace

void parallel_rows(int n, int least, const std::function<void(int, int)>& body, int align) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_unique<Pool>(1);
  const int threads = g_pool->size();
  const int chunks = std::clamp(n / least, 1, threads == 1 ? 1 : 4 * threads);
  const auto bound = [&](int c) {
    if (c == chunks) return n;
    const auto at = static_cast<int>(static_cast<int64_t>(n) * c / chunks);
    return at - at % align;
  };
  g_pool->run(chunks, [&](int c) { body(bound(c), bound(c + 1)); });
}

int pool_threads() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  return g_pool ? g_pool->size() : 1;
}

int set_threads(int threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  threads = std::clamp(threads, 1, 256);  // a call's chunks (4 per thread) fit in 16 bits
  if (!g_pool || g_pool->size() != threads) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(threads);
  }
  return g_pool->size();
}

}  // namespace hotlora
