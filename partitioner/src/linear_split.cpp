// Minimum-bottleneck split of a topological order into contiguous segments, for large graphs: a binary search on
// the bottleneck B whose feasibility test costs O(n log n * ceil(k / 64)), instead of chain_split's O(k n^2)
// dynamic program.
//
// A segment [i, j) costs the sum over its positions u of node_cost(u) plus u's sends whose last consumer lies at
// or beyond j. For a fixed end j that sum only shrinks as i grows, so the starts that keep the segment within B
// are an interval [first_start(j), j): a Fenwick tree over the per-position terms (dropping a send once j passes
// its last consumer) finds first_start(j) in O(log n). The memory limit also only
// bounds the start from below, and so do the pins, because along the order the pinned stages never decrease: the
// starts after the last pinned position allow any stage, those back to the previous change of pinned stage allow
// only that stage, earlier ones none. Each position keeps the set of segment counts that can end there as a
// bitmask; the counts reaching j are the union over an interval of starts, shifted by one: an incrementally built
// sparse table answers that union in O(1) words.

#include <algorithm>
#include <cstdint>

#include "graph_internals.h"

namespace smp::part::detail {
namespace {

class FenwickTree {
 public:
  explicit FenwickTree(const std::vector<double>& values) : tree_(values.size() + 1, 0.0) {
    for (std::size_t i = 1; i < tree_.size(); ++i) {
      tree_[i] += values[i - 1];
      const std::size_t parent = i + (i & (~i + 1));
      if (parent < tree_.size()) tree_[parent] += tree_[i];
    }
  }
  void add(int index, double delta) {
    for (std::size_t i = index + 1; i < tree_.size(); i += i & (~i + 1)) tree_[i] += delta;
  }
  double prefix(int count) const {
    double sum = 0;
    for (std::size_t i = count; i > 0; i -= i & (~i + 1)) sum += tree_[i];
    return sum;
  }
  // The smallest count with prefix(count) >= target (the terms are non-negative, so prefixes never decrease).
  int first_prefix_at_least(double target) const {
    if (target <= 0) return 0;
    std::size_t below = 0, step = 1;
    while (step * 2 < tree_.size()) step *= 2;
    double sum_below = 0;
    for (; step > 0; step /= 2) {
      if (below + step < tree_.size() && sum_below + tree_[below + step] < target) {
        below += step;
        sum_below += tree_[below];
      }
    }
    return static_cast<int>(below) + 1;
  }

 private:
  std::vector<double> tree_;
};

// Sets of segment counts 1..k, bit t-1 for t segments, in `words` 64-bit words per set.
class CountSets {
 public:
  CountSets(int num_sets, int num_stages)
      : words_((num_stages + 63) / 64), num_stages_(num_stages), bits_(static_cast<std::size_t>(num_sets) * words_) {}
  int words() const { return words_; }
  std::uint64_t* operator[](int set) { return bits_.data() + static_cast<std::size_t>(set) * words_; }
  const std::uint64_t* operator[](int set) const { return bits_.data() + static_cast<std::size_t>(set) * words_; }
  bool has(int set, int count) const { return (*this)[set][(count - 1) / 64] >> ((count - 1) % 64) & 1; }
  void clear(int set) { std::fill_n((*this)[set], words_, 0); }
  // into |= the counts of `from` plus one, those that stay within the k stages; `only_count`, when positive,
  // keeps that count alone.
  void add_successors(std::uint64_t* into, const std::uint64_t* from, int only_count = 0) const {
    for (int w = 0; w < words_; ++w) {
      std::uint64_t shifted = from[w] << 1 | (w > 0 ? from[w - 1] >> 63 : 0);
      if (w == words_ - 1 && num_stages_ % 64 != 0) shifted &= (std::uint64_t{1} << (num_stages_ % 64)) - 1;
      if (only_count > 0) shifted &= (only_count - 1) / 64 == w ? std::uint64_t{1} << ((only_count - 1) % 64) : 0;
      into[w] |= shifted;
    }
  }

 private:
  int words_, num_stages_;
  std::vector<std::uint64_t> bits_;
};

class SegmentSearch {
 public:
  SegmentSearch(const LinearProblem& problem, int num_stages)
      : problem_(problem),
        num_positions_(static_cast<int>(problem.node_cost.size())),
        num_stages_(num_stages),
        position_cost_(num_positions_),
        sends_ending_at_(num_positions_),
        first_start_by_memory_(num_positions_ + 1, 0),
        first_start_(num_positions_ + 1, 0),
        last_pinned_before_(num_positions_ + 1, -1),
        pin_changed_before_(num_positions_ + 1, -1),
        counts_(num_positions_ + 1, num_stages),
        merged_(counts_.words()) {
    for (int u = 0; u < num_positions_; ++u) position_cost_[u] = problem.node_cost[u];
    for (const LinearProblem::Send& send : problem.sends) {
      position_cost_[send.producer] += send.cost;
      sends_ending_at_[send.last_consumer].push_back(send);
    }
    for (double cost : position_cost_) total_cost_ += cost;
    double memory = 0;
    for (int start = 0, end = 1; end <= num_positions_; ++end) {
      memory += problem.memory_bytes[end - 1];
      while (start < end && memory > problem.memory_limit_bytes) memory -= problem.memory_bytes[start++];
      first_start_by_memory_[end] = start;
    }
    for (int end = 1; end <= num_positions_; ++end) {
      const int position = end - 1;
      const bool pinned = !problem.pinned.empty() && problem.pinned[position] >= 0;
      last_pinned_before_[end] = pinned ? position : last_pinned_before_[position];
      const int previous = last_pinned_before_[position];
      pin_changed_before_[end] = !pinned ? pin_changed_before_[position]
                                 : previous >= 0 && problem.pinned[previous] != problem.pinned[position]
                                     ? previous
                                     : pin_changed_before_[position];
    }
    int levels = 1;
    while ((1 << levels) <= num_positions_ + 1) ++levels;
    for (int level = 0; level < levels; ++level) table_.emplace_back(num_positions_ + 1, num_stages);
  }

  // Every segment costs at most the whole order with every send counted.
  double bottleneck_upper_bound() const { return total_cost_ * (1 + 1e-12); }

  bool feasible(double bottleneck) {
    FenwickTree segment_cost(position_cost_);
    for (int end = 1; end <= num_positions_; ++end) {
      for (const LinearProblem::Send& send : sends_ending_at_[end - 1]) segment_cost.add(send.producer, -send.cost);
      const int by_cost = segment_cost.first_prefix_at_least(segment_cost.prefix(end) - bottleneck);
      first_start_[end] = std::max(by_cost, first_start_by_memory_[end]);
    }
    counts_.clear(0);  // position 0 ends zero segments, which the sets do not hold: see union_of_starts
    record_in_table(0);
    for (int end = 1; end <= num_positions_; ++end) {
      counts_.clear(end);
      std::uint64_t* reach = counts_[end];
      const int first = first_start_[end], last_pinned = last_pinned_before_[end];
      union_of_starts(std::max(first, last_pinned + 1), end - 1, reach, 0);
      if (last_pinned >= 0) {
        union_of_starts(std::max(first, pin_changed_before_[end] + 1), last_pinned, reach,
                        problem_.pinned[last_pinned] + 1);
      }
      record_in_table(end);
    }
    return counts_.has(num_positions_, num_stages_);
  }

  // The stage of each position, from the last feasible() that returned true: each segment starts as late as the
  // reachable starts allow.
  std::vector<int> stages() const {
    std::vector<int> stage_of_position(num_positions_);
    for (int stage = num_stages_ - 1, end = num_positions_; stage >= 0; --stage) {
      int start = end - 1;
      while (!(stage == 0 ? start == 0 : counts_.has(start, stage))) --start;
      std::fill(stage_of_position.begin() + start, stage_of_position.begin() + end, stage);
      end = start;
    }
    return stage_of_position;
  }

 private:
  // reach |= the counts ending at a start in [low, high], plus one (only `only_count` when positive).
  void union_of_starts(int low, int high, std::uint64_t* reach, int only_count) {
    if (low > high) return;
    int level = 0;
    while ((2 << level) <= high - low + 1) ++level;
    const std::uint64_t* left = table_[level][low];
    const std::uint64_t* right = table_[level][high - (1 << level) + 1];
    for (int w = 0; w < counts_.words(); ++w) merged_[w] = left[w] | right[w];
    counts_.add_successors(reach, merged_.data(), only_count);
    if (low == 0 && only_count <= 1) reach[0] |= 1;  // a first segment from position 0
  }

  // table_[level][i] = union of counts_ over [i, i + 2^level), filled as soon as its last position is known.
  void record_in_table(int position) {
    std::copy_n(counts_[position], counts_.words(), table_[0][position]);
    for (int level = 1; level < static_cast<int>(table_.size()); ++level) {
      const int start = position - (1 << level) + 1;
      if (start < 0) break;
      const std::uint64_t* left = table_[level - 1][start];
      const std::uint64_t* right = table_[level - 1][start + (1 << (level - 1))];
      std::uint64_t* into = table_[level][start];
      for (int w = 0; w < counts_.words(); ++w) into[w] = left[w] | right[w];
    }
  }

  const LinearProblem& problem_;
  const int num_positions_, num_stages_;
  std::vector<double> position_cost_;                // node cost plus all its sends
  double total_cost_ = 0;
  std::vector<std::vector<LinearProblem::Send>> sends_ending_at_;  // by the position of their last consumer
  std::vector<int> first_start_by_memory_;           // per segment end: the memory limit's earliest start
  std::vector<int> first_start_;                     // per segment end: the earliest start within the bottleneck
  std::vector<int> last_pinned_before_;              // per segment end j: the last pinned position < j, or -1
  std::vector<int> pin_changed_before_;              // per j: the last pinned position before it whose stage
                                                     // differs from the last pinned one's, or -1
  CountSets counts_;                                 // per position: the segment counts that can end there
  std::vector<CountSets> table_;                     // sparse table of unions of counts_ (see record_in_table)
  std::vector<std::uint64_t> merged_;                // scratch: one union
};

}  // namespace

std::optional<std::vector<int>> split_min_bottleneck(const LinearProblem& problem, int num_stages) {
  SegmentSearch search(problem, num_stages);
  double high = search.bottleneck_upper_bound();
  if (!search.feasible(high)) return std::nullopt;
  // Bisection to a relative 1e-12: about 45 rounds from [0, total] for k <= 64.
  double low = 0;
  while (high - low > 1e-12 * high) {
    const double middle = low + (high - low) / 2;
    if (middle <= low || middle >= high) break;
    (search.feasible(middle) ? high : low) = middle;
  }
  search.feasible(high);
  return search.stages();
}

}  // namespace smp::part::detail
