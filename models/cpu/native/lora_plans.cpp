// LoRA plans: RowResiduals' passes, and the checks that build AdapterPairs and RowPlan.
#include "lora_plans.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>

#include "thread_pool.h"

namespace hotlora {

void RowResiduals::add(const RowPlan& plan, int slot, int N, float* out) {
  const int j = static_cast<int>(products_.size());
  const int per_row = M_ / plan.rows();
  for (int m = 0; m < M_; m++) {
    first_.push_back(static_cast<int>(units_.size()));
    const int s = m / per_row;
    for (int e = plan.offsets[s]; e < plan.offsets[s + 1]; e++) {
      const AdapterPairs::Pair* pair = plan.adapters[plan.entries[e]]->at(slot);
      if (pair == nullptr) continue;  // no weights here: adds nothing
      units_.push_back({j, m, pair, plan.scales[e], floats_});
      floats_ += pair->r;
      widest_ = std::max(widest_, pair->r);
    }
  }
  spans_.push_back(std::max(1, N / 512));
  products_.push_back({N, out});
}

std::pair<int, int> RowResiduals::units_of(int j, int m) const {
  const size_t row = static_cast<size_t>(j) * M_ + m;
  return {first_[row], row + 1 < first_.size() ? first_[row + 1] : static_cast<int>(units_.size())};
}

void RowResiduals::activate(const int* us, int rows, const float* x) {
  const float* xs[kLoraRows];
  float scales[kLoraRows];
  float* hs[kLoraRows];
  for (int g = 0; g < rows; g++) {
    const Unit& unit = units_[us[g]];
    xs[g] = x + static_cast<size_t>(unit.m) * K_;
    scales[g] = unit.scale;
    hs[g] = h_.data() + unit.h;
  }
  const AdapterPairs::Pair& p = *units_[us[0]].pair;
  if (p.half)
    kernel_->low_rank_half(xs, static_cast<const uint16_t*>(p.a), K_, p.r, scales, hs, rows);
  else
    kernel_->low_rank(xs, static_cast<const float*>(p.a), K_, p.r, scales, hs, rows);
}

void RowResiduals::add_residual(const int* us, int rows, int n0, int n1) const {
  const float* hs[kLoraRows];
  float* outs[kLoraRows];
  const Product& product = products_[units_[us[0]].j];
  for (int g = 0; g < rows; g++) {
    const Unit& unit = units_[us[g]];
    hs[g] = h_.data() + unit.h;
    outs[g] = product.out + static_cast<size_t>(unit.m) * product.N;
  }
  const AdapterPairs::Pair& p = *units_[us[0]].pair;
  if (p.half)
    kernel_->residuals_half(hs, static_cast<const uint16_t*>(p.b), product.N, columns_.data(), p.r,
                            outs, rows, n0, n1);
  else
    kernel_->residuals(hs, static_cast<const float*>(p.b), product.N, columns_.data(), p.r, outs,
                       rows, n0, n1);
}

bool RowResiduals::same_pairs(int m, int n) const {
  for (int j = 0; j < static_cast<int>(products_.size()); j++) {
    auto [u, end] = units_of(j, m);
    auto [v, v_end] = units_of(j, n);
    if (end - u != v_end - v) return false;
    for (; u < end; u++, v++)
      if (units_[u].pair != units_[v].pair) return false;
  }
  return true;
}

void RowResiduals::group_rows() {
  std::vector<uint64_t> signatures(M_, 0);
  for (const Unit& unit : units_)  // each row's pairs, in order, hashed (FNV-1a's step)
    signatures[unit.m] =
        (signatures[unit.m] ^ reinterpret_cast<uintptr_t>(unit.pair)) * 1099511628211ull;
  std::vector<char> taken(M_, 0);
  groups_.clear();
  group_starts_.assign(1, 0);
  for (int m = 0; m < M_; m++) {
    if (taken[m]) continue;
    groups_.push_back(m);
    int size = 1;
    for (int n = m + 1; n < M_ && size < kLoraRows; n++)
      if (!taken[n] && signatures[n] == signatures[m] && same_pairs(m, n))
        groups_.push_back(n), taken[n] = 1, size++;
    group_starts_.push_back(static_cast<int>(groups_.size()));
  }
}

void RowResiduals::ask_heads(int m) const {
  for (int j = 0; j < static_cast<int>(products_.size()); j++)
    for (auto [u, end] = units_of(j, m); u < end; u++) {
      const AdapterPairs::Pair& p = *units_[u].pair;
      const size_t size = p.half ? 2 : 4;
      for (const auto& [at, bytes] : {std::pair{p.a, size * p.K * p.r}, {p.b, size * p.r * p.N}})
        prefetch_ahead(static_cast<const uint8_t*>(at),
                       static_cast<int>(std::min<size_t>(bytes, kHeadBytes)));
    }
}

namespace {
std::atomic<int64_t> g_lora_nanoseconds{0};
}  // namespace

double lora_seconds() { return 1e-9 * static_cast<double>(g_lora_nanoseconds.exchange(0)); }

void RowResiduals::apply(const float* x) {
  if (units_.empty()) return;
  const auto began = std::chrono::steady_clock::now();
  run(x);
  g_lora_nanoseconds +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - began)
          .count();
}

int RowResiduals::group_units(int g, int j, int t, int* us) const {
  const int* group = groups_.data() + group_starts_[g];
  const int size = group_starts_[g + 1] - group_starts_[g];
  for (int i = 0; i < size; i++) us[i] = units_of(j, group[i]).first + t;
  return size;
}

void RowResiduals::run(const float* x) {
  h_.resize(floats_);
  columns_.resize(widest_);
  for (int r = 0; r < widest_; r++) columns_[r] = r;
  const int count = static_cast<int>(products_.size());
  group_rows();
  const int groups = static_cast<int>(group_starts_.size()) - 1;
  if (M_ >= kRowsAThread * pool_threads()) {
    const auto rows = [&](int g0, int g1) {
      int us[kLoraRows];
      for (int g = g0; g < g1; g++) {
        const int m = first_row(g);
        ask_heads(m);
        // apply(j, size) for each unit of row m, in order, us holding the same unit of every
        // row of the group (product j's t-th).
        const auto each_unit = [&](const auto& apply) {
          for (int j = 0; j < count; j++) {
            const auto [first, end] = units_of(j, m);
            for (int t = 0; t < end - first; t++) apply(j, group_units(g, j, t, us));
          }
        };
        each_unit([&](int, int size) { activate(us, size, x); });
        each_unit([&](int j, int size) { add_residual(us, size, 0, products_[j].N); });
      }
    };
    parallel_rows(groups, 1, rows, /*align=*/1);
    return;
  }
  // Fewer rows: items of a product, a group and a span of the product's columns (product j's
  // from items[j]), each adding the group's residuals on its span; where every product is one
  // span, each item computes the group's activations of its product first, else a pass before
  // computes every group's.
  const bool one_pass = std::all_of(spans_.begin(), spans_.end(), [](int n) { return n == 1; });
  std::vector<int> items(1, 0);
  for (int j = 0; j < count; j++) items.push_back(items.back() + groups * spans_[j]);
  if (!one_pass) {
    std::vector<std::array<int, 3>> units;  // group, product, the unit's place in the row's
    for (int g = 0; g < groups; g++)
      for (int j = 0; j < count; j++) {
        const auto [first, end] = units_of(j, first_row(g));
        for (int t = 0; t < end - first; t++) units.push_back({g, j, t});
      }
    parallel_rows(
        static_cast<int>(units.size()), 1,
        [&](int u0, int u1) {
      int us[kLoraRows];
      for (int u = u0; u < u1; u++) {
        const auto [g, j, t] = units[u];
        activate(us, group_units(g, j, t, us), x);
      }
        },
        /*align=*/1);
  }
  const auto spans = [&](int c0, int c1) {
    int us[kLoraRows];
    int j = 0;
    for (int c = c0; c < c1; c++) {
      while (c >= items[j + 1]) j++;
      const int N = products_[j].N, per_group = spans_[j], g = (c - items[j]) / per_group,
                part = (c - items[j]) % per_group;
      const auto [first, end] = units_of(j, first_row(g));
      for (int t = 0; t < end - first; t++) {
        const int size = group_units(g, j, t, us);
        if (one_pass) activate(us, size, x);
        add_residual(us, size, bound(N, per_group, part), bound(N, per_group, part + 1));
      }
    }
  };
  parallel_rows(items.back(), 1, spans, /*align=*/1);
}

int RowResiduals::bound(int N, int spans, int part) {
  const int at = static_cast<int>(static_cast<int64_t>(N) * part / spans);
  return part == spans ? N : at - at % 16;
}

void check_plan(const char* name, const mx::array& x, int N, const RowPlan& plan, int slot) {
  check_plan(name, x.size() / x.shape(-1), x.shape(-1), N, plan, slot);
}

void check_plan(const char* name, int64_t M, int K, int N, const RowPlan& plan, int slot) {
  if (active_kernel() == nullptr)
    throw std::invalid_argument(std::string(name) + ": no vector kernel for this CPU");
  if (M % plan.rows() != 0)
    throw std::invalid_argument(std::string(name) +
                                ": the plan's rows must divide x's rows evenly");
  for (const auto& adapter : plan.adapters) {
    const AdapterPairs::Pair* pair = adapter->at(slot);
    if (pair != nullptr && (pair->K != K || pair->N != N))
      throw std::invalid_argument(std::string(name) + ": an adapter's pair at slot " +
                                  std::to_string(slot) + " is [" + std::to_string(pair->K) +
                                  ", r], [r, " + std::to_string(pair->N) + "], not [" +
                                  std::to_string(K) + ", r], [r, " + std::to_string(N) + "]");
  }
}

std::shared_ptr<AdapterPairs> adapter_pairs(
    const std::vector<std::optional<std::pair<mx::array, mx::array>>>& pairs) {
  auto out = std::make_shared<AdapterPairs>();
  for (const auto& found : pairs) {
    if (!found) {
      out->slots.emplace_back();
      continue;
    }
    auto [a, b] = *found;
    a.eval(), b.eval();
    const auto dtype = a.dtype();
    if ((dtype != mx::float32 && dtype != mx::float16) || b.dtype() != dtype || a.ndim() != 2 ||
        b.ndim() != 2 || a.shape(1) == 0 || b.shape(0) != a.shape(1) || !a.flags().row_contiguous ||
        !b.flags().row_contiguous)
      throw std::invalid_argument(
          "adapter_pairs: expected pairs a [K, r], b [r, N], both float32 or both float16, "
          "row-major");
    out->slots.push_back(AdapterPairs::Pair{a.data<void>(), b.data<void>(), a.shape(0), a.shape(1),
                                            b.shape(1), dtype == mx::float16});
    out->arrays.push_back(std::move(a));
    out->arrays.push_back(std::move(b));
  }
  return out;
}

std::shared_ptr<RowPlan> row_plan(std::vector<std::shared_ptr<AdapterPairs>> adapters,
                                  std::vector<int32_t> offsets, std::vector<int32_t> entries,
                                  std::vector<float> scales) {
  const int count = static_cast<int>(adapters.size());
  const int E = static_cast<int>(entries.size());
  bool ok = offsets.size() >= 2 && offsets.front() == 0 && offsets.back() == E &&
            scales.size() == entries.size();
  for (size_t s = 0; ok && s + 1 < offsets.size(); s++) ok = offsets[s] <= offsets[s + 1];
  for (int e = 0; ok && e < E; e++) ok = entries[e] >= 0 && entries[e] < count;
  for (const auto& adapter : adapters) ok = ok && adapter != nullptr;
  if (!ok)
    throw std::invalid_argument(
        "row_plan: the offsets must rise from 0 to the entries' count, one row at least, each "
        "entry name one of the adapters, with one scale each");
  return std::make_shared<RowPlan>(std::move(adapters), std::move(offsets), std::move(entries),
                                   std::move(scales));
}

}  // namespace hotlora
