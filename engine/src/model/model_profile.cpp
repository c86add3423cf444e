// A profile at any microbatch size (through its two profiled sizes), its experts marked, and how unevenly counted
// routing loads an expert-parallel group's busiest rank: what the planner prices each layout from.
#include "smp/layout_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace smp {

namespace {

// Through (batch, small) and (larger_batch, large), never below zero or falling with the batch.
double through(double small, double large, int batch, int larger_batch, int samples) {
  if (larger_batch <= batch) return small * samples / batch;
  const double per_sample = std::max(0.0, (large - small) / (larger_batch - batch));
  return std::max(0.0, small - per_sample * batch) + per_sample * samples;
}

}  // namespace

std::vector<ModuleProfile> ModelProfile::at(int samples, double compute_scale) const {
  const bool two = larger.size() == modules.size() && larger_batch > batch;
  std::vector<ModuleProfile> result = modules;
  for (std::size_t i = 0; i < result.size(); ++i) {
    auto& module = result[i];
    const ModuleProfile& large = two ? larger[i] : modules[i];
    const int larger_samples = two ? larger_batch : 0;
    module.forward_s = compute_scale * through(module.forward_s, large.forward_s, batch, larger_samples, samples);
    module.backward_s = compute_scale * through(module.backward_s, large.backward_s, batch, larger_samples, samples);
    module.backward_input_s =
        compute_scale * through(module.backward_input_s, large.backward_input_s, batch, larger_samples, samples);
    module.backward_weight_s =
        compute_scale * through(module.backward_weight_s, large.backward_weight_s, batch, larger_samples, samples);
    module.assumed_loss_s =
        compute_scale * through(module.assumed_loss_s, large.assumed_loss_s, batch, larger_samples, samples);
    module.output_bytes = module.output_bytes * samples / batch;
    module.activation_bytes = module.activation_bytes * samples / batch;
    if (module.weight_pass_bytes > 0) module.weight_pass_bytes = module.weight_pass_bytes * samples / batch;
    module.tp_forward_ring_bytes = module.tp_forward_ring_bytes * samples / batch;
    module.tp_backward_ring_bytes = module.tp_backward_ring_bytes * samples / batch;
    module.expert_token_bytes = module.expert_token_bytes * samples / batch;
  }
  return result;
}

void ModelProfile::mark_experts(const std::map<std::string, std::int64_t>& token_bytes, int experts_per_layer,
                                int split, const std::map<std::string, ExpertRouting>& routed,
                                int experts_per_token) {
  experts = experts_per_layer;
  experts_split = std::max(1, split);
  std::set<std::string> rows_placed;
  for (auto& node : modules) {
    // parameter_shapes: "path:d0,d1,;" for each parameter the node counts, all of one element size here. Stacked
    // experts' first dimension is their count.
    struct Held {
      std::string name;
      std::int64_t elements = 1;
      std::int64_t first_dimension = 0;
    };
    std::vector<Held> parameters;
    std::int64_t elements = 0;
    for (auto& [name, sizes] : parameter_shapes_of(node)) {
      Held held{std::move(name)};
      for (std::int64_t size : sizes) held.elements *= size;
      held.first_dimension = sizes.empty() ? 0 : sizes.front();
      elements += held.elements;
      parameters.push_back(std::move(held));
    }
    if (elements == 0) continue;
    const double element_bytes = static_cast<double>(node.parameter_bytes) / static_cast<double>(elements);
    const auto bytes_of = [&](std::int64_t count) {
      return static_cast<std::int64_t>(static_cast<double>(count) * element_bytes);
    };
    std::int64_t expert_elements = 0, frozen_expert_elements = 0;
    double expert_work = 0.0;  // per token: top-k of each layer's experts
    std::set<std::string> layers_held;
    for (const auto& parameter : parameters) {
      const auto layer = std::find_if(token_bytes.begin(), token_bytes.end(), [&](const auto& entry) {
        return parameter.name.rfind(entry.first + ".", 0) == 0;
      });
      if (layer == token_bytes.end()) {
        node.largest_other_parameter_bytes = std::max(node.largest_other_parameter_bytes, bytes_of(parameter.elements));
        continue;
      }
      node.largest_expert_parameter_bytes = std::max(node.largest_expert_parameter_bytes, bytes_of(parameter.elements));
      expert_elements += parameter.elements;
      if (std::find(node.frozen_parameters.begin(), node.frozen_parameters.end(), parameter.name) !=
          node.frozen_parameters.end()) {
        frozen_expert_elements += parameter.elements;
      }
      expert_work += static_cast<double>(experts_per_token) * static_cast<double>(parameter.elements) /
                     static_cast<double>(std::max<std::int64_t>(1, parameter.first_dimension));
      if (!layers_held.insert(layer->first).second) continue;  // the layer's rows and routing once per node
      if (const auto counted = routed.find(layer->first); counted != routed.end()) {
        node.expert_routing.push_back(counted->second);
      }
      if (rows_placed.insert(layer->first).second) node.expert_token_bytes += layer->second;
    }
    if (expert_elements == 0) continue;
    node.expert_parameter_bytes += bytes_of(expert_elements);
    node.frozen_expert_parameter_bytes += bytes_of(frozen_expert_elements);
    const double dense_work = static_cast<double>(elements - expert_elements);
    node.expert_compute_share = experts_per_token > 0 ? expert_work / (expert_work + dense_work) : 1.0;
  }
}

double routing_imbalance(const ExpertRouting& routing, int ep, int samples) {
  if (ep <= 1 || routing.empty()) return 1.0;
  const auto experts = static_cast<int>(routing.front().size());
  if (experts == 0 || experts % ep != 0) return 1.0;
  const int share = experts / ep;
  // Each row's share of its rows per block of experts.
  std::vector<std::vector<double>> shares;
  for (const auto& row : routing) {
    if (static_cast<int>(row.size()) != experts) return 1.0;
    if (std::any_of(row.begin(), row.end(), [](std::int64_t count) { return count < 0; })) continue;
    const auto total = static_cast<double>(std::accumulate(row.begin(), row.end(), std::int64_t{0}));
    if (total <= 0) continue;
    std::vector<double>& blocks = shares.emplace_back(static_cast<std::size_t>(ep), 0.0);
    for (int expert = 0; expert < experts; ++expert) blocks[expert / share] += static_cast<double>(row[expert]) / total;
  }
  if (shares.empty()) return 1.0;
  const auto rows = static_cast<double>(shares.size());
  const double even = 1.0 / ep;
  std::vector<double> mean(static_cast<std::size_t>(ep), 0.0), spread(static_cast<std::size_t>(ep), 0.0);
  for (const auto& blocks : shares) {
    for (int block = 0; block < ep; ++block) mean[block] += blocks[block] / rows;
  }
  // One row has no spread to read: its tokens' chance, as if each chose independently (a lower bound: a sequence's
  // tokens route alike more often than that).
  double tokens = 0.0;
  for (const auto& row : routing) tokens += static_cast<double>(std::accumulate(row.begin(), row.end(), std::int64_t{0}));
  double skew = 0.0, chance = 0.0;  // the mean's squared distance from even, and how much of it noise explains
  for (int block = 0; block < ep; ++block) {
    if (shares.size() > 1) {
      for (const auto& blocks : shares) spread[block] += std::pow(blocks[block] - mean[block], 2) / (rows - 1.0);
    } else {
      spread[block] = mean[block] * (1.0 - mean[block]) / std::max(1.0, tokens);
    }
    skew += std::pow(mean[block] - even, 2);
    chance += spread[block] / rows;
  }
  const double kept = skew > 0.0 ? std::max(0.0, 1.0 - chance / skew) : 0.0;
  // The busiest block of an exchange of `samples`, each block's share drawn about its lasting share with the spread
  // of a mean of that many rows: averaged over fixed draws, so that a plan is the same every time.
  std::mt19937 draws(12345);
  std::normal_distribution<double> normal;
  constexpr int kDraws = 512;
  std::vector<double> lasting(static_cast<std::size_t>(ep)), deviation(static_cast<std::size_t>(ep));
  for (int block = 0; block < ep; ++block) {
    lasting[block] = even + kept * (mean[block] - even);
    deviation[block] = std::sqrt(spread[block] / std::max(1, samples));
  }
  double busiest = 0.0;
  for (int draw = 0; draw < kDraws; ++draw) {
    double most = 0.0;
    for (int block = 0; block < ep; ++block) most = std::max(most, lasting[block] + deviation[block] * normal(draws));
    most = std::min(most, 1.0);
    busiest += most / kDraws;
  }
  return std::max(1.0, busiest * ep);
}

}  // namespace smp
