// LoRA plans: the adapters' pairs as mounted (AdapterPairs), a batch's adapters and each row's
// entries (RowPlan), and the gathered residuals that a quantized product adds from them
// (RowResiduals, on the active Kernel's low_rank and residuals kernels).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "kernels/table.h"
#include "mlx/array.h"

namespace hotlora {

namespace mx = mlx::core;

// One adapter's pairs as mounted, at each LoRA slot of the model that it has weights at: a [K, r]
// and b [r, N], row-major, float32 (`--adapter-dtype float32`) or float16 (the default). The
// arrays are held here, so a primitive that holds this reads them wherever Python's references
// have gone; they are not the primitive's inputs (evaluated once, at the mount), so a step's
// graph carries no array of any adapter. Made and shared from C++ alone (enable_shared_from_this:
// nanobind hands C++ the object's own shared_ptr, not one whose deleter takes the GIL), so the
// last reference, dropped where a step ran, frees it there without waiting for Python.
struct AdapterPairs : std::enable_shared_from_this<AdapterPairs> {
  struct Pair {
    const void* a;
    const void* b;
    int K, r, N;
    bool half;
  };
  std::vector<mx::array> arrays;
  std::vector<std::optional<Pair>> slots;  // by slot number

  const Pair* at(int slot) const {
    return slot >= 0 && static_cast<size_t>(slot) < slots.size() && slots[slot] ? &*slots[slot]
                                                                                : nullptr;
  }
};

// The adapters of one batch's rows and each row's entries, the same at every slot: its S + 1
// offsets into the E entries (row s's are [offsets[s], offsets[s + 1])), each entry's adapter
// (an index into `adapters`) and scale, in its set's order. At a slot an entry whose adapter has
// no weights there adds nothing. Shared from C++ alone, as AdapterPairs.
struct RowPlan : std::enable_shared_from_this<RowPlan> {
  RowPlan(std::vector<std::shared_ptr<AdapterPairs>> adapters, std::vector<int32_t> offsets,
          std::vector<int32_t> entries, std::vector<float> scales)
      : adapters(std::move(adapters)),
        offsets(std::move(offsets)),
        entries(std::move(entries)),
        scales(std::move(scales)) {}

  std::vector<std::shared_ptr<AdapterPairs>> adapters;
  std::vector<int32_t> offsets;
  std::vector<int32_t> entries;
  std::vector<float> scales;

  int rows() const { return static_cast<int>(offsets.size()) - 1; }
};

// The gathered form of QuantMatmul's LoRA (Punica's BGMV): each adapter's pair is read where it
// is mounted, and the plan says which adapters each row applies, in its set's order, at which
// scale. A row computes only its own adapters' activations (low_rank_rows), then, after its base
// product, adds (h * scale) @ b for each of them in order, column by column (add_residuals): the
// operations on a row's outputs are fixed by its own set alone, so its bits are the same alone
// and beside any other rows and adapters, and no pair is copied. RowResiduals does this for one
// product (QuantMatmulGather) or for several products of the same rows (QuantMatmulHeads' q, k
// and v, or gate and up), after their base products: one pass of the pool's threads (`apply`).
class RowResiduals {
 public:
  // Rows of M inputs K wide, those of every product added.
  RowResiduals(const Kernel* kernel, int M, int K) : kernel_(kernel), M_(M), K_(K) {}

  // One product's residuals at `slot`, added to `out` [M, N] row-major (its base product): one
  // unit per row and entry of its set whose adapter has weights at the slot (row m is the plan's
  // row m / (M / S)).
  void add(const RowPlan& plan, int slot, int N, float* out);

  bool empty() const { return units_.empty(); }

  // Every unit's residual added to its product's base output, computed before this: each row's
  // activations of its adapters, h = scale * (x[m] @ a) (x [M, K] row-major), then h @ b on its
  // outputs. Rows that apply the same pairs (same_pairs) go up to kLoraRows at a time
  // (group_rows), each pair read once for them and each row's operations those it takes alone.
  // At kRowsAThread rows a thread of the pool or more, one pass of the threads, a group at a
  // time: its activations, then its residuals on each product's outputs (one wait on the pool a
  // call, and a row's a and b read by the thread that has its h). Fewer rows, a pass of items
  // that each take a group's residuals on a span of about 512 columns or more of a product, so
  // that a few rows' residuals take every thread (b's rows read in runs of about 1 KiB or more,
  // which the memory streams, not in a tile's few cache lines each): where every product is
  // one span, each item computes its group's activations first (one pass a call, q, k and v's
  // or o's on the embedded model); else a pass of every group's activations comes before (gate
  // and up's), so that no activations are computed twice. Two rows on the embedded model
  // (AVX2, two threads), against two passes of rows alone: two float32 adapters' passes 2.5-2.8
  // -> 2.15-2.4 ms a step, two float16 ones 1.53-1.88 -> 1.50-1.65; the ~0.8B llama, 4.2-4.3 ->
  // 3.1 and 2.56 -> 2.0.
  void apply(const float* x);

 private:
  static constexpr int kRowsAThread = 4;

  void run(const float* x);  // `apply`'s passes

  struct Product {
    int N;
    float* out;
  };
  struct Unit {
    int j, m;  // product, row
    const AdapterPairs::Pair* pair;
    float scale;
    size_t h;  // its activations' offset
  };

  // A span's bounds: multiples of 16 (whole vectors), but the last.
  static int bound(int N, int spans, int part);

  // Units us[0 .. rows) (rows <= kLoraRows, units of one product and one pair, each of its own
  // row): their activations; their residuals on their rows' outputs [n0, n1).
  void activate(const int* us, int rows, const float* x);
  void add_residual(const int* us, int rows, int n0, int n1) const;
  // Whether rows m and n apply the same pairs, in the same order, at every product (their
  // scales may differ): the kernels' calls then read each pair once for both.
  bool same_pairs(int m, int n) const;
  // The rows in groups of up to kLoraRows of the same pairs (groups_, each group's rows from
  // group_starts_[g]), each row in one, in the order of their first rows.
  void group_rows();
  // us[i]: product j's t-th unit of group g's i-th row; returns the group's rows.
  int group_units(int g, int j, int t, int* us) const;
  // Group g's first row.
  int first_row(int g) const { return groups_[group_starts_[g]]; }
  // Product j's row m's units, [first, end).
  std::pair<int, int> units_of(int j, int m) const;
  // Asks for the first kHeadBytes of each of row m's a and b, before the first is read: the row's
  // streams start together, not each a memory's wait after the one before (the hardware's prefetch
  // follows a stream only once it has seen it). 16 rows of 16 distinct rank-16 adapters, gate's
  // pairs of the embedded model: the LoRA's part of a call 80 -> ~75 us.
  void ask_heads(int m) const;
  static constexpr int kHeadBytes = 512;

  const Kernel* kernel_;
  int M_, K_;
  std::vector<Product> products_;
  std::vector<Unit> units_;
  std::vector<int> first_;  // product j's row m's units start at first_[j * M + m]
  std::vector<int> spans_;  // each product's spans a group of rows (fewer rows' pass)
  size_t floats_ = 0;
  int widest_ = 0;
  std::vector<float> h_;      // every unit's activations, each written by one item
  std::vector<int> columns_;  // 0 .. widest_ - 1: every column of an adapter, in order
  std::vector<int> groups_, group_starts_;
};

// The seconds that RowResiduals' `apply` calls have taken since the last call of this (their
// wall time on the threads that made them), then none: what a step's LoRA residuals cost, as a
// benchmark reads it (tests/bench/adapter_steps.py).
double lora_seconds();

// Checks that a plan serves x's M rows (its rows divide them evenly) and that each of its
// adapters' pairs at `slot` takes x's K inputs to N outputs.
void check_plan(const char* name, const mx::array& x, int N, const RowPlan& plan, int slot);
// The same for M rows of K inputs.
void check_plan(const char* name, int64_t M, int K, int N, const RowPlan& plan, int slot);

// An adapter's pairs for the gathered kernels: pairs[slot] is (a [K, r], b [r, N]), both float32
// or both float16, row-major, or None where it has no weights. Each is evaluated here.
std::shared_ptr<AdapterPairs> adapter_pairs(
    const std::vector<std::optional<std::pair<mx::array, mx::array>>>& pairs);

// A batch's plan: its adapters (each's pairs, once), then the S + 1 offsets into the entries,
// each entry's adapter (an index into `adapters`) and its scale.
std::shared_ptr<RowPlan> row_plan(std::vector<std::shared_ptr<AdapterPairs>> adapters,
                                  std::vector<int32_t> offsets, std::vector<int32_t> entries,
                                  std::vector<float> scales);

}  // namespace hotlora
