// Minimum-bottleneck split of a topological order into contiguous segments, for large graphs: a binary search on
// the bottleneck B whose feasibility test costs O(n log n * ceil(k / 64)) when all stages cost alike, instead of
// chain_split's O(k n^2) dynamic program.
//
// A segment [i, j) costs the sum over its positions u of node_cost(u) plus u's sends whose last consumer lies at
// or beyond j. For a fixed end j that sum only shrinks as i grows, so the starts that keep the segment within B
// are an interval [first_start(j), j): a Fenwick tree over the per-position terms (dropping a send once j passes
// its last consumer) finds first_start(j) in O(log n). The memory limit also only bounds the start from below, and
// so do the pins, because along the order the pinned stages never decrease: the starts after the last pinned
// position allow any stage, those back to the previous change of pinned stage allow only that stage, earlier ones
// none. Each position keeps the set of segment counts that can end there as a bitmask; the counts reaching j are
// the union over an interval of starts, shifted by one: an incrementally built sparse table answers that union in
// O(1) words.
//
// When stages cost differently (activation copies per stage, recomputation, devices of different speed or memory),
// the interval depends on the stage.
// Then each stage's segment ending at j tries the latest position where the stages before it can end: O(n k)
// plus O(log n) per distinct start tried (see feasible_per_stage).
//
// When every segment must hold a position with parameters, that bounds the start from above: no later than the
// last such position before j.

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
  // The smallest count with a.prefix(count) + b.prefix(count) >= target, for trees of one size (the terms are
  // non-negative, so prefixes never decrease). A sum of trees descends like one tree: the stages' cost classes
  // share the tree of sends.
  static int first_prefix_at_least(const FenwickTree& a, const FenwickTree& b, double target) {
    if (target <= 0) return 0;
    const std::size_t size = a.tree_.size();
    std::size_t below = 0, step = 1;
    while (step * 2 < size) step *= 2;
    double sum_below = 0;
    for (; step > 0; step /= 2) {
      if (below + step < size) {
        const double node = a.tree_[below + step] + b.tree_[below + step];
        if (sum_below + node < target) {
          below += step;
          sum_below += node;
        }
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
  void insert(int set, int count) { (*this)[set][(count - 1) / 64] |= std::uint64_t{1} << ((count - 1) % 64); }
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

// A term of the problem's per-position costs, 0 where the problem leaves it empty.
double term(const std::vector<double>& values, int position) { return values.empty() ? 0.0 : values[position]; }

class SegmentSearch {
 public:
  SegmentSearch(const LinearProblem& problem, int num_stages)
      : problem_(problem),
        num_positions_(static_cast<int>(problem.node_cost.size())),
        num_stages_(num_stages),
        sends_ending_at_(num_positions_),
        last_pinned_before_(num_positions_ + 1, -1),
        latest_start_(num_positions_ + 1, -1),
        pin_changed_before_(num_positions_ + 1, -1),
        counts_(num_positions_ + 1, num_stages),
        merged_(counts_.words()) {
    group_stages_by_factors();
    send_cost_.assign(num_positions_, 0.0);
    double total_send_cost = 0;
    for (const LinearProblem::Send& send : problem.sends) {
      sends_ending_at_[send.last_consumer].push_back(send);
      send_cost_[send.producer] += send.cost;
      total_send_cost += send.cost;
    }
    for (FactorClass& factors : classes_) {
      std::vector<double> node_cost(num_positions_);
      factors.cost_prefix.assign(num_positions_ + 1, 0.0);
      for (int u = 0; u < num_positions_; ++u) {
        node_cost[u] = problem.node_cost[u] + factors.copies * term(problem.activation_cost, u) +
                       factors.compute_factor *
                           (term(problem.compute_cost, u) + factors.recomputes * term(problem.recompute_cost, u));
        factors.cost_prefix[u + 1] = factors.cost_prefix[u] + node_cost[u];
      }
      if (classes_.size() == 1) factors.node_costs = FenwickTree(node_cost);  // feasible_for_one_class's descent
      total_cost_ = std::max(total_cost_, factors.cost_prefix.back() + total_send_cost);
      factors.first_start_by_memory.assign(num_positions_ + 1, 0);
      if (classes_.size() == 1) factors.first_start.assign(num_positions_ + 1, 0);
      auto memory_at = [&](int u) { return problem.memory_bytes[u] + factors.copies * term(problem.activation_bytes, u); };
      double memory = 0;
      for (int start = 0, end = 1; end <= num_positions_; ++end) {
        memory += memory_at(end - 1);
        while (start < end && memory > factors.memory_limit) memory -= memory_at(start++);
        factors.first_start_by_memory[end] = start;
      }
    }
    for (int end = 1; end <= num_positions_; ++end) {
      const int position = end - 1;
      const bool required = problem.holds_parameters.empty() || problem.holds_parameters[position];
      latest_start_[end] = required ? position : latest_start_[position];
      const bool pinned = !problem.pinned.empty() && problem.pinned[position] >= 0;
      last_pinned_before_[end] = pinned ? position : last_pinned_before_[position];
      const int previous = last_pinned_before_[position];
      pin_changed_before_[end] = !pinned ? pin_changed_before_[position]
                                 : previous >= 0 && problem.pinned[previous] != problem.pinned[position]
                                     ? previous
                                     : pin_changed_before_[position];
    }
    if (classes_.size() > 1) return;  // the sparse table serves feasible_for_one_class only
    int levels = 1;
    while ((1 << levels) <= num_positions_ + 1) ++levels;
    for (int level = 0; level < levels; ++level) table_.emplace_back(num_positions_ + 1, num_stages);
  }

  // Every segment costs at most the whole order with every send counted, under the costliest factors.
  double bottleneck_upper_bound() const { return total_cost_ * (1 + 1e-12); }

  bool feasible(double bottleneck) {
    return classes_.size() == 1 ? feasible_for_one_class(bottleneck) : feasible_per_stage(bottleneck);
  }

  // The stage of each position, from the last feasible() that returned true: each segment starts as late as the
  // reachable starts allow.
  std::vector<int> stages() const {
    std::vector<int> stage_of_position(num_positions_);
    for (int stage = num_stages_ - 1, end = num_positions_; stage >= 0; --stage) {
      int start = latest_start_[end];
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

  // All stages cost alike: per segment end, one descent finds the earliest start within the bottleneck, and one
  // sparse-table query unites the counts over the allowed starts.
  bool feasible_for_one_class(double bottleneck) {
    FactorClass& factors = classes_.front();
    FenwickTree sends(send_cost_);
    for (int end = 1; end <= num_positions_; ++end) {
      for (const LinearProblem::Send& send : sends_ending_at_[end - 1]) sends.add(send.producer, -send.cost);
      const int by_cost = FenwickTree::first_prefix_at_least(
          factors.node_costs, sends, factors.cost_prefix[end] + sends.prefix(end) - bottleneck);
      factors.first_start[end] = std::max(by_cost, factors.first_start_by_memory[end]);
    }
    counts_.clear(0);  // position 0 ends zero segments, which the sets do not hold: see union_of_starts
    record_in_table(0);
    for (int end = 1; end <= num_positions_; ++end) {
      counts_.clear(end);
      std::uint64_t* reach = counts_[end];
      const int first = factors.first_start[end], last_pinned = last_pinned_before_[end];
      const int latest = latest_start_[end];
      union_of_starts(std::max(first, last_pinned + 1), latest, reach, 0);
      if (last_pinned >= 0) {
        union_of_starts(std::max(first, pin_changed_before_[end] + 1), std::min(last_pinned, latest), reach,
                        problem_.pinned[last_pinned] + 1);
      }
      record_in_table(end);
    }
    return counts_.has(num_positions_, num_stages_);
  }

  // Stages cost differently, so the earliest start differs per stage; instead of one descent per stage and end,
  // each stage's segment tries only the latest position where the stages before it can end. That suffices: the
  // allowed starts form an interval up to latest_start_[end] (the cost only falls as the start moves later, and
  // the memory limit and the pins bound the start from below), so if any start in it works, the latest one does.
  bool feasible_per_stage(double bottleneck) {
    FenwickTree sends(send_cost_);
    // latest_end_[t]: the latest position so far where t segments can end (position 0 ends zero), or -1;
    // bounded_end_[t]: the same at most latest_start_[end], which is end - 1 or stays where it was, so a copy of
    // latest_end_ taken whenever it is end - 1 keeps it.
    std::fill(latest_end_.begin(), latest_end_.end(), -1);
    std::fill(bounded_end_.begin(), bounded_end_.end(), -1);
    latest_end_[0] = 0;
    counts_.clear(0);
    for (int end = 1; end <= num_positions_; ++end) {
      if (latest_start_[end] == end - 1) bounded_end_ = latest_end_;
      for (const LinearProblem::Send& send : sends_ending_at_[end - 1]) sends.add(send.producer, -send.cost);
      const double sends_before_end = sends.prefix(end);
      int cached_start = -1;  // most stages try the same few starts: their sends' prefix is asked once
      double sends_before_start = 0;
      counts_.clear(end);
      const int last_pinned = last_pinned_before_[end];
      const int stages_ending_here = std::min(num_stages_, end);  // every segment holds a position
      for (int stage = 0; stage < stages_ending_here; ++stage) {
        const int start = bounded_end_[stage];
        if (start < 0) continue;
        const FactorClass& factors = classes_[class_of_stage_[stage]];
        int lowest_start = factors.first_start_by_memory[end];
        if (last_pinned >= 0) {
          const int pinned_from = problem_.pinned[last_pinned] == stage ? pin_changed_before_[end] : last_pinned;
          lowest_start = std::max(lowest_start, pinned_from + 1);
        }
        if (start < lowest_start) continue;
        if (start != cached_start) cached_start = start, sends_before_start = sends.prefix(start);
        const double cost =
            factors.cost_prefix[end] - factors.cost_prefix[start] + sends_before_end - sends_before_start;
        if (cost <= bottleneck) counts_.insert(end, stage + 1);
      }
      for (int count = 1; count <= stages_ending_here; ++count) {
        if (counts_.has(end, count)) latest_end_[count] = end;
      }
    }
    return counts_.has(num_positions_, num_stages_);
  }

  // Stages whose factors are equal form a class, with its own costs. Factors that no position's terms use cannot
  // matter (without activation terms, every stage's copies are alike): the fewer classes, the faster the search.
  void group_stages_by_factors() {
    auto any_nonzero = [](std::initializer_list<const std::vector<double>*> lists) {
      for (const auto* values : lists) {
        for (double value : *values) {
          if (value != 0) return true;
        }
      }
      return false;
    };
    const bool copies_matter = any_nonzero({&problem_.activation_cost, &problem_.activation_bytes});
    const bool recomputes_matter = any_nonzero({&problem_.recompute_cost});
    const bool speeds_matter = any_nonzero({&problem_.compute_cost, &problem_.recompute_cost});
    class_of_stage_.assign(num_stages_, 0);
    latest_end_.assign(num_stages_ + 1, -1);
    bounded_end_.assign(num_stages_ + 1, -1);
    for (int stage = 0; stage < num_stages_; ++stage) {
      FactorClass factors;
      if (copies_matter) factors.copies = problem_.activation_copies.empty() ? 1.0 : problem_.activation_copies[stage];
      if (recomputes_matter) factors.recomputes = !problem_.recomputes.empty() && problem_.recomputes[stage] ? 1.0 : 0.0;
      if (speeds_matter && !problem_.compute_factors.empty()) factors.compute_factor = problem_.compute_factors[stage];
      if (!problem_.memory_limits.empty()) factors.memory_limit = problem_.memory_limits[stage];
      auto same = std::find_if(classes_.begin(), classes_.end(), [&](const FactorClass& other) {
        return other.copies == factors.copies && other.recomputes == factors.recomputes &&
               other.compute_factor == factors.compute_factor && other.memory_limit == factors.memory_limit;
      });
      if (same == classes_.end()) same = classes_.insert(classes_.end(), factors);
      class_of_stage_[stage] = static_cast<int>(same - classes_.begin());
    }
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

  // The stages that share activation copies, recomputation and their device, and what their segments cost.
  struct FactorClass {
    double copies = 1.0, recomputes = 0.0, compute_factor = 1.0, memory_limit = kInfinity;
    FenwickTree node_costs{{}};              // per position, under these factors; sends apart
    std::vector<double> cost_prefix;         // the same, summed: cost_prefix[j] over positions < j
    std::vector<int> first_start_by_memory;  // per segment end: the memory limit's earliest start
    std::vector<int> first_start;            // per segment end: the earliest start within the bottleneck (one
                                             // class only)
  };

  const LinearProblem& problem_;
  const int num_positions_, num_stages_;
  std::vector<FactorClass> classes_;
  std::vector<int> class_of_stage_;
  std::vector<int> latest_end_, bounded_end_;        // scratch of feasible_per_stage
  double total_cost_ = 0;
  std::vector<double> send_cost_;  // per position: all its sends, before any consumer is reached
  std::vector<std::vector<LinearProblem::Send>> sends_ending_at_;  // by the position of their last consumer
  std::vector<int> last_pinned_before_;              // per segment end j: the last pinned position < j, or -1
  std::vector<int> latest_start_;                    // per j: the latest start a segment ending at j may have (j - 1,
                                                     // or the last position < j with parameters when each segment
                                                     // needs one), or -1
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
