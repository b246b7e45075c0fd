// How fast the LoRA kernels read an adapter's pair (kernels/lora_gather.h: a row's activations,
// low_rank, then its residual, add_residuals), without MLX: one row a pair, each thread taking
// every threads-th pair of `footprint` bytes of pairs, so that pairs cycled within a cache are
// the kernels' arithmetic and pairs cycled over far more than the last-level cache are what 16
// rows of 16 distinct adapters read from memory each step. Beside it, a plain read of the same
// bytes on the same threads (64-bit words summed): the memory's own rate for one long stream.
// tests/bench/lora_reads.py builds it with the kernels' sources and the extension's flags.
//
//   lora_reads K N RANK HALF FOOTPRINT_BYTES THREADS SECONDS READ
//
// prints one line: `isa lora_gb_s read_gb_s` (the kernels' ISA; bytes of the pairs, or read, a
// second, all threads), read_gb_s `-` where READ is 0 (no plain read).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "kernels/table.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs body(thread, pass) on `threads` threads, each pass after pass until `seconds` have gone;
// returns the passes done by all and the seconds they took.
template <typename Body>
std::pair<long, double> timed(int threads, double seconds, Body body) {
  std::atomic<bool> stop{false};
  std::vector<long> passes(threads, 0);
  std::vector<std::thread> workers;
  const auto start = Clock::now();
  for (int t = 0; t < threads; t++)
    workers.emplace_back([&, t] {
      while (!stop.load(std::memory_order_relaxed)) body(t, passes[t]++);
    });
  while (seconds_since(start) < seconds) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  stop.store(true);
  for (auto& w : workers) w.join();
  const double took = seconds_since(start);
  long all = 0;
  for (long p : passes) all += p;
  return {all, took};
}

template <typename T>
double lora_rate(const hotlora::Kernel& kernel, int K, int N, int r, size_t pairs, int threads,
                 double seconds) {
  const size_t a_size = static_cast<size_t>(K) * r, b_size = static_cast<size_t>(r) * N;
  // Small values (float16 0.0625, float32 1), so that the sums stay finite.
  const T value = sizeof(T) == 2 ? T(0x2c00) : T(1);
  std::vector<T> a(pairs * a_size, value), b(pairs * b_size, value);
  std::vector<int> columns(r);
  for (int i = 0; i < r; i++) columns[i] = i;
  std::vector<std::vector<float>> x(threads, std::vector<float>(K, 0.01f)),
      h(threads, std::vector<float>(r)), out(threads, std::vector<float>(N, 0.0f));
  const auto pass = [&](int t, long i) {
    const size_t p = (static_cast<size_t>(i) * threads + t) % pairs;
    const float* xs[1] = {x[t].data()};
    float* hs[1] = {h[t].data()};
    const float* hc[1] = {h[t].data()};
    float* outs[1] = {out[t].data()};
    const float scale[1] = {1.0f};
    if constexpr (sizeof(T) == 2) {
      kernel.low_rank_half(xs, a.data() + p * a_size, K, r, scale, hs, 1);
      kernel.residuals_half(hc, b.data() + p * b_size, N, columns.data(), r, outs, 1, 0, N);
    } else {
      kernel.low_rank(xs, a.data() + p * a_size, K, r, scale, hs, 1);
      kernel.residuals(hc, b.data() + p * b_size, N, columns.data(), r, outs, 1, 0, N);
    }
  };
  for (int t = 0; t < threads; t++)  // every page touched once before the clock starts
    for (long i = 0; static_cast<size_t>(i) * threads < pairs; i++) pass(t, i);
  const auto [passes, took] = timed(threads, seconds, pass);
  return static_cast<double>(passes) * (a_size + b_size) * sizeof(T) / took / 1e9;
}

double read_rate(size_t bytes, int threads, double seconds) {
  const size_t words = bytes / 8 / threads * threads;
  std::vector<uint64_t> data(words, 1);
  std::vector<uint64_t> sums(threads * 8, 0);  // a cache line a thread
  const size_t share = words / threads;
  const auto pass = [&](int t, long) {
    const uint64_t* p = data.data() + t * share;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= share; i += 4) {
      s0 += p[i];
      s1 += p[i + 1];
      s2 += p[i + 2];
      s3 += p[i + 3];
    }
    sums[t * 8] += s0 + s1 + s2 + s3;
  };
  const auto [passes, took] = timed(threads, seconds, pass);
  uint64_t all = 0;
  for (uint64_t s : sums) all += s;
  if (all == 0) std::printf("nothing read\n");  // keeps the sums from being optimized away
  return static_cast<double>(passes) * share * 8 / took / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: %s K N RANK HALF FOOTPRINT_BYTES THREADS SECONDS READ\n", argv[0]);
    return 2;
  }
  const int K = std::atoi(argv[1]), N = std::atoi(argv[2]), r = std::atoi(argv[3]);
  const bool half = std::atoi(argv[4]) != 0;
  const size_t footprint = std::strtoull(argv[5], nullptr, 10);
  const int threads = std::atoi(argv[6]);
  const double seconds = std::atof(argv[7]);
  const bool read = std::atoi(argv[8]) != 0;
  const hotlora::Kernel* kernel = hotlora::find_kernel();
  if (kernel == nullptr) {
    std::fprintf(stderr, "no kernel this CPU runs\n");
    return 1;
  }
  const size_t pair_bytes =
      (static_cast<size_t>(K) * r + static_cast<size_t>(r) * N) * (half ? 2 : 4);
  const size_t pairs = std::max<size_t>(threads, footprint / pair_bytes);
  const double lora = half ? lora_rate<uint16_t>(*kernel, K, N, r, pairs, threads, seconds)
                           : lora_rate<float>(*kernel, K, N, r, pairs, threads, seconds);
  std::printf("%s %.2f ", kernel->isa, lora);
  if (read)
    std::printf("%.2f\n", read_rate(pairs * pair_bytes, threads, seconds));
  else
    std::printf("-\n");
  return 0;
}
