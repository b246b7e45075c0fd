// LoRA plans: RowResiduals' passes, and the checks that build AdapterPairs and RowPlan.
#include "lora_plans.h"

#include <algorithm>
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
  items_.push_back(items_.back() + M_ * spans_.back());
  products_.push_back({N, out});
}

void RowResiduals::activations(const float* x) {
  h_.resize(floats_);
  const auto body = [&](int u0, int u1) {
    for (int u = u0; u < u1; u++) {
      const Unit& unit = units_[u];
      const float* row = x + static_cast<size_t>(unit.m) * K_;
      const AdapterPairs::Pair& p = *unit.pair;
      if (p.half)
        kernel_->low_rank_half(row, static_cast<const uint16_t*>(p.a), K_, p.r, unit.scale,
                               h_.data() + unit.h);
      else
        kernel_->low_rank(row, static_cast<const float*>(p.a), K_, p.r, unit.scale,
                          h_.data() + unit.h);
    }
  };
  parallel_rows(static_cast<int>(units_.size()), 4, body, /*align=*/1);
}

void RowResiduals::residuals() {
  std::vector<int> columns(widest_);  // every column of an adapter, in order
  for (int r = 0; r < widest_; r++) columns[r] = r;
  const auto body = [&](int c0, int c1) {
    int j = 0;
    for (int c = c0; c < c1; c++) {
      while (c >= items_[j + 1]) j++;
      const Product& p = products_[j];
      const int spans = spans_[j], m = (c - items_[j]) / spans, part = (c - items_[j]) % spans;
      const int n0 = bound(p.N, spans, part), n1 = bound(p.N, spans, part + 1);
      float* out = p.out + static_cast<size_t>(m) * p.N;
      const size_t row = static_cast<size_t>(j) * M_ + m;
      const int end = row + 1 < first_.size() ? first_[row + 1] : static_cast<int>(units_.size());
      for (int u = first_[row]; u < end; u++) {
        const Unit& unit = units_[u];
        const AdapterPairs::Pair& pair = *unit.pair;
        if (pair.half)
          kernel_->residuals_half(h_.data() + unit.h, static_cast<const uint16_t*>(pair.b), p.N,
                                  columns.data(), pair.r, out, n0, n1);
        else
          kernel_->residuals(h_.data() + unit.h, static_cast<const float*>(pair.b), p.N,
                             columns.data(), pair.r, out, n0, n1);
      }
    }
  };
  parallel_rows(items_.back(), 1, body, /*align=*/1);
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
