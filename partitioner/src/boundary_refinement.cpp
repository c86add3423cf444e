// Local search after the contiguous split: that split is optimal only for its node order and for its estimate of
// where each output's consumers land, so on DAGs moves across stage boundaries, judged by the exact objective,
// can still lower the bottleneck.

#include <algorithm>

#include "graph_internals.h"

namespace smp::part::detail {
namespace {

class BoundaryRefinement {
 public:
  BoundaryRefinement(const ModuleGraph& graph, const Adjacency& adjacency, const CostModel& costs,
                     const GraphPartitionOptions& options, std::vector<int> stage_of_node)
      : graph_(graph),
        adjacency_(adjacency),
        costs_(costs),
        pinned_(options.pinned),
        num_stages_(options.num_stages),
        stage_of_node_(std::move(stage_of_node)),
        totals_(num_stages_),
        nodes_of_stage_(num_stages_),
        slot_in_stage_(stage_of_node_.size()),
        sent_bytes_of_(num_stages_),
        candidate_epoch_(stage_of_node_.size(), 0) {
    for (int node = 0; node < num_nodes(); ++node) {
      const int stage = stage_of_node_[node];
      totals_[stage].add(graph_.nodes[node]);
      totals_[stage].sent_bytes += sent_bytes_of_.of_producer(adjacency_, stage_of_node_, node);
      slot_in_stage_[node] = static_cast<int>(nodes_of_stage_[stage].size());
      nodes_of_stage_[stage].push_back(node);
    }
  }

  // Each accepted move lowers the slowest stage's cost below the bottleneck and keeps every stage it touches
  // below it too, so (bottleneck, number of stages at it) falls strictly and the search cannot cycle. The budget
  // of evaluated moves bounds the time on large graphs, where the split before has left little to gain.
  std::vector<int> run() {
    const long max_evaluations = 20L * num_nodes() + 20000;
    for (long evaluations = 0; evaluations < max_evaluations;) {
      int slowest = 0;
      for (int stage = 1; stage < num_stages_; ++stage) {
        if (stage_cost(stage) > stage_cost(slowest)) slowest = stage;
      }
      Move best{-1, -1, -1, stage_cost(slowest) * (1 - 1e-12)};  // strictly better, beyond rounding noise
      collect_candidates(slowest);
      for (int node : candidates_) {
        const auto [earliest, latest] = allowed_stages(node);
        for (int to = earliest; to <= latest; ++to) {
          if (to == stage_of_node_[node]) continue;
          const double worst = single_move_cost(node, to, slowest);
          if (worst < best.worst_cost) best = Move{node, to, -1, worst};
          ++evaluations;
        }
      }
      producers_ = nodes_of_stage_[slowest];  // a copy: trying a regrouping reorders the stage's list
      for (int producer : producers_) evaluations += consider_regrouping(producer, slowest, best);
      if (best.node < 0) break;
      touched_.clear();
      if (best.regroup_from < 0) {
        move(best.node, best.to);
      } else {
        regroup(best.node, best.regroup_from, best.to);
      }
    }
    return std::move(stage_of_node_);
  }

 private:
  // One node to `to`, or (when regroup_from >= 0) every consumer of `node` on stage regroup_from to `to`.
  struct Move {
    int node, to, regroup_from;
    double worst_cost;  // the largest cost, after the move, among the stages it touches and the slowest stage
  };
  struct StageDelta {
    int stage;
    StageTotals change;
  };

  int num_nodes() const { return static_cast<int>(graph_.nodes.size()); }

  double stage_cost(int stage) const { return costs_.stage_cost(stage, totals_[stage]); }

  // Keeping every edge forward: no earlier than any predecessor, no later than any successor.
  std::pair<int, int> allowed_stages(int node) const {
    int earliest = 0, latest = num_stages_ - 1;
    for (int predecessor : adjacency_.predecessors[node]) earliest = std::max(earliest, stage_of_node_[predecessor]);
    for (int successor : adjacency_.successors[node]) latest = std::min(latest, stage_of_node_[successor]);
    return {earliest, latest};
  }

  bool pinned(int node) const { return !pinned_.empty() && pinned_[node] >= 0; }

  // The nodes whose move can lower the slowest stage's cost: its own, and the consumers of its outputs (pulled
  // into it, or moved to a stage that already receives the same output, they save it a send).
  void collect_candidates(int slowest) {
    candidates_.clear();
    if (++epoch_ == 0) std::fill(candidate_epoch_.begin(), candidate_epoch_.end(), 0u), epoch_ = 1;
    auto add = [&](int node) {
      if (candidate_epoch_[node] == epoch_ || pinned(node) || nodes_of_stage_[stage_of_node_[node]].size() < 2) return;
      candidate_epoch_[node] = epoch_;
      candidates_.push_back(node);
    };
    for (int node : nodes_of_stage_[slowest]) {
      add(node);
      for (int successor : adjacency_.successors[node]) add(successor);
    }
  }

  StageDelta& delta_of(int stage) {
    for (StageDelta& delta : deltas_) {
      if (delta.stage == stage) return delta;
    }
    return deltas_.emplace_back(StageDelta{stage, StageTotals{}});
  }

  // Fills deltas_ with the change of every stage touched by moving `node` to `to`: its own stage and `to` trade
  // its compute, memory and output; its predecessors' stages may send to one stage more or fewer.
  void collect_deltas(int node, int to) {
    deltas_.clear();
    const int from = stage_of_node_[node];
    const GraphNode& info = graph_.nodes[node];
    const auto& predecessors = adjacency_.predecessors[node];
    sent_before_.resize(predecessors.size());
    for (std::size_t i = 0; i < predecessors.size(); ++i) {
      sent_before_[i] = sent_bytes_of_.of_producer(adjacency_, stage_of_node_, predecessors[i]);
    }
    const double own_sent_before = sent_bytes_of_.of_producer(adjacency_, stage_of_node_, node);
    stage_of_node_[node] = to;
    const double own_sent_after = sent_bytes_of_.of_producer(adjacency_, stage_of_node_, node);
    for (std::size_t i = 0; i < predecessors.size(); ++i) {
      const double change = sent_bytes_of_.of_producer(adjacency_, stage_of_node_, predecessors[i]) - sent_before_[i];
      if (change != 0) delta_of(stage_of_node_[predecessors[i]]).change.sent_bytes += change;
    }
    stage_of_node_[node] = from;
    StageTotals& leaving = delta_of(from).change;
    leaving.add(info, -1.0);
    leaving.sent_bytes -= own_sent_before;
    StageTotals& arriving = delta_of(to).change;
    arriving.add(info);
    arriving.sent_bytes += own_sent_after;
  }

  // The largest cost, after moving `node` to `to`, among the stages the move changes and the slowest stage (a move
  // that leaves the slowest stage as it is gains nothing).
  double single_move_cost(int node, int to, int slowest) {
    collect_deltas(node, to);
    delta_of(slowest);
    double worst = 0;
    for (const StageDelta& delta : deltas_) {
      worst = std::max(worst, costs_.stage_cost(delta.stage, totals_[delta.stage] + delta.change));
    }
    return worst;
  }

  // Records in touched_ the stages whose totals change.
  void move(int node, int to) {
    collect_deltas(node, to);
    for (const StageDelta& delta : deltas_) {
      totals_[delta.stage] += delta.change;
      touched_.push_back(delta.stage);
    }
    std::vector<int>& old_stage = nodes_of_stage_[stage_of_node_[node]];
    const int slot = slot_in_stage_[node];
    old_stage[slot] = old_stage.back();
    slot_in_stage_[old_stage[slot]] = slot;
    old_stage.pop_back();
    slot_in_stage_[node] = static_cast<int>(nodes_of_stage_[to].size());
    nodes_of_stage_[to].push_back(node);
    stage_of_node_[node] = to;
  }

  // A producer's output reaches each consuming stage once, so single moves cannot save a send to a stage with
  // several of its consumers. Moving all of them together (to another consuming stage, or into the producer's)
  // can: tries each pair of stages, applying the moves and undoing them. Returns the node moves evaluated.
  long consider_regrouping(int producer, int slowest, Move& best) {
    const int own = stage_of_node_[producer];
    consuming_stages_.clear();
    for (int consumer : adjacency_.successors[producer]) {
      if (stage_of_node_[consumer] != own) consuming_stages_.push_back(stage_of_node_[consumer]);
    }
    std::sort(consuming_stages_.begin(), consuming_stages_.end());
    consuming_stages_.erase(std::unique(consuming_stages_.begin(), consuming_stages_.end()), consuming_stages_.end());
    long evaluated = 0;
    for (int from : consuming_stages_) {
      auto try_target = [&](int to) {
        touched_.clear();
        const int moved = regroup(producer, from, to);
        evaluated += moved;
        double worst = moved > 0 ? stage_cost(slowest) : kInfinity;
        for (int stage : touched_) worst = std::max(worst, stage_cost(stage));
        for (int i = moved - 1; i >= 0; --i) move(regrouped_[i], from);
        if (worst < best.worst_cost) best = Move{producer, to, from, worst};
      };
      try_target(own);
      for (int to : consuming_stages_) {
        if (to != from) try_target(to);
      }
    }
    return evaluated;
  }

  // Moves the consumers of `producer` on stage `from` to `to`, sinks first when moving later (sources first when
  // moving earlier) so that each single move keeps the edges forward; they are listed in regrouped_. Moves
  // nothing (returns 0) when one of them is pinned or cannot go, or the stage would empty.
  int regroup(int producer, int from, int to) {
    regrouped_.clear();
    for (int consumer : adjacency_.successors[producer]) {
      if (stage_of_node_[consumer] != from) continue;
      if (pinned(consumer)) return 0;
      regrouped_.push_back(consumer);
    }
    if (regrouped_.size() >= nodes_of_stage_[from].size()) return 0;
    if (to > from) std::reverse(regrouped_.begin(), regrouped_.end());  // successors are sorted by index
    int moved = 0;
    for (; moved < static_cast<int>(regrouped_.size()); ++moved) {
      const auto [earliest, latest] = allowed_stages(regrouped_[moved]);
      if (to < earliest || to > latest) break;
      move(regrouped_[moved], to);
    }
    if (moved == static_cast<int>(regrouped_.size())) return moved;
    for (int i = moved - 1; i >= 0; --i) move(regrouped_[i], from);
    return 0;
  }

  const ModuleGraph& graph_;
  const Adjacency& adjacency_;
  const CostModel& costs_;
  const std::vector<int>& pinned_;
  const int num_stages_;
  std::vector<int> stage_of_node_;
  std::vector<StageTotals> totals_;
  std::vector<std::vector<int>> nodes_of_stage_;
  std::vector<int> slot_in_stage_;  // a node's index in nodes_of_stage_
  SentBytes sent_bytes_of_;
  std::vector<int> candidates_;
  std::vector<unsigned> candidate_epoch_;  // marks the nodes already in candidates_
  unsigned epoch_ = 0;
  std::vector<StageDelta> deltas_;          // scratch for one move
  std::vector<double> sent_before_;        // scratch: the predecessors' sent bytes before the move
  std::vector<int> touched_;               // stages changed by the moves since it was cleared
  std::vector<int> producers_, consuming_stages_, regrouped_;  // scratch for regrouping
};

}  // namespace

std::vector<int> refine_bottleneck(const ModuleGraph& graph, const Adjacency& adjacency, const CostModel& costs,
                                   const GraphPartitionOptions& options, std::vector<int> stage_of_node) {
  return BoundaryRefinement(graph, adjacency, costs, options, std::move(stage_of_node)).run();
}

}  // namespace smp::part::detail
