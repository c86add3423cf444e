#include "smp/cluster_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "smp/config.h"

namespace smp {
namespace {

using nlohmann::json;

// Reads `object`'s keys into the fields `numbers` points at; anything else, or a value out of range, names the key.
void read_keys(const json& object, const std::string& source, const std::map<std::string, double*>& numbers,
               const std::map<std::string, int*>& integers, const std::map<std::string, std::string*>& strings = {},
               const std::map<std::string, bool*>& flags = {}) {
  if (!object.is_object()) throw ConfigError(source + ": expected a JSON object");
  for (const auto& [key, value] : object.items()) {
    if (auto number = numbers.find(key); number != numbers.end()) {
      if (!value.is_number() || !(value.get<double>() > 0) || !std::isfinite(value.get<double>())) {
        throw ConfigError(source + ": key \"" + key + "\": expected a positive number, got " + value.dump());
      }
      *number->second = value.get<double>();
    } else if (auto integer = integers.find(key); integer != integers.end()) {
      if (!value.is_number_integer() || value.get<long long>() < 1 || value.get<long long>() > (1LL << 30)) {
        throw ConfigError(source + ": key \"" + key + "\": expected a positive integer up to 2^30, got " + value.dump());
      }
      *integer->second = value.get<int>();
    } else if (auto text = strings.find(key); text != strings.end() && value.is_string()) {
      *text->second = value.get<std::string>();
    } else if (auto flag = flags.find(key); flag != flags.end() && value.is_boolean()) {
      *flag->second = value.get<bool>();
    } else {
      std::string known;
      const auto list = [&known](const std::string& name) { known += (known.empty() ? "" : ", ") + name; };
      for (const auto& [name, _] : numbers) list(name);
      for (const auto& [name, _] : integers) list(name);
      for (const auto& [name, _] : strings) list(name);
      for (const auto& [name, _] : flags) list(name);
      throw ConfigError(source + ": unknown key \"" + key + "\" or a value of the wrong type (keys: " + known + ")");
    }
  }
}

json parsed(const std::string& text, const std::string& source) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& error) {
    throw ConfigError(source + ": not valid JSON: " + error.what());
  }
}

// Ring all-reduce of `bytes` over `members`: 2 (n - 1) steps of latency, 2 (n - 1) / n of the bytes each way.
double ring_all_reduce_s(double bytes, int members, double latency_s, double bytes_per_s) {
  if (members < 2) return 0.0;
  return 2.0 * (members - 1) * latency_s + 2.0 * (members - 1) / members * bytes / bytes_per_s;
}

}  // namespace

ClusterSpec ClusterSpec::from_json_text(const std::string& text, const std::string& source) {
  const json object = parsed(text, source);
  ClusterSpec spec;
  read_keys(object, source,
            {{"device_memory_gib", &spec.device_memory_gib}, {"peak_tflops", &spec.peak_tflops},
             {"compute_efficiency", &spec.compute_efficiency}, {"memory_tbps", &spec.memory_tbps},
             {"intra_node_gbps", &spec.intra_node_gbps}, {"inter_node_gbps", &spec.inter_node_gbps},
             {"intra_node_latency_us", &spec.intra_node_latency_us},
             {"inter_node_latency_us", &spec.inter_node_latency_us}},
            {{"nodes", &spec.nodes}, {"devices_per_node", &spec.devices_per_node}});
  if (spec.compute_efficiency > 1) {
    throw ConfigError(source + ": key \"compute_efficiency\": a fraction of peak, at most 1");
  }
  return spec;
}

double DecoderShape::layer_parameters() const {
  const double head_width = static_cast<double>(hidden) / heads;
  const double attention = 2.0 * hidden * hidden + 2.0 * hidden * kv_heads * head_width;  // q, o; k, v
  return attention + 3.0 * hidden * ffn + 2.0 * hidden;                                // gated MLP, two norms
}

double DecoderShape::parameters() const {
  const double embedding = static_cast<double>(vocab) * hidden;
  return layers * layer_parameters() + embedding * (tied_embeddings ? 1 : 2) + hidden;
}

double DecoderShape::flops_per_token() const {
  const double multiplying = layers * layer_parameters() + static_cast<double>(vocab) * hidden + hidden;
  return 6.0 * multiplying + 12.0 * layers * static_cast<double>(hidden) * sequence;
}

constexpr int kMostLayers = 1 << 16;

DecoderShape DecoderShape::from_json_text(const std::string& text, const std::string& source) {
  const json object = parsed(text, source);
  DecoderShape shape;
  read_keys(object, source, {},
            {{"layers", &shape.layers}, {"hidden", &shape.hidden}, {"ffn", &shape.ffn}, {"heads", &shape.heads},
             {"kv_heads", &shape.kv_heads}, {"vocab", &shape.vocab}, {"sequence", &shape.sequence}},
            {{"name", &shape.name}}, {{"tied_embeddings", &shape.tied_embeddings}});
  if (shape.layers > kMostLayers) {  // a profile holds a module per layer
    throw ConfigError(source + ": key \"layers\": at most " + std::to_string(kMostLayers) + ", got " +
                      std::to_string(shape.layers));
  }
  if (shape.hidden % shape.heads != 0 || shape.heads % shape.kv_heads != 0) {
    throw ConfigError(source + ": \"hidden\" must divide by \"heads\", and \"heads\" by \"kv_heads\"");
  }
  return shape;
}

ModelProfile decoder_profile(const DecoderShape& shape, const ClusterSpec& cluster, int tp) {
  const double flops_per_s = cluster.peak_tflops * 1e12 * cluster.compute_efficiency;
  const double s = shape.sequence, h = shape.hidden;
  const double bf16 = 2.0, fp32 = 4.0;
  // Megatron's block under tp: two all-reduces of the [s, h] activations forward (after attention and after the
  // MLP), two backward (before them).
  const double tp_all_reduce_s =
      ring_all_reduce_s(bf16 * s * h, tp, cluster.intra_node_latency_us * 1e-6, cluster.intra_node_gbps * 1e9);
  ModelProfile profile;
  profile.batch = 1;
  auto add = [&](const std::string& name, double forward_flops, double parameters, double activation_bytes,
                 double collectives_s, double elementwise_bytes = 0.0) {
    ModuleProfile module;
    module.name = name;
    const double memory_bound_s = elementwise_bytes / tp / (cluster.memory_tbps * 1e12);
    module.forward_s = forward_flops / tp / flops_per_s + memory_bound_s + collectives_s;
    module.backward_s = 2.0 * (forward_flops / tp / flops_per_s + memory_bound_s) + collectives_s;
    module.parameter_bytes = static_cast<std::int64_t>(fp32 * parameters / tp);
    module.output_bytes = static_cast<std::int64_t>(bf16 * s * h);
    module.activation_bytes = static_cast<std::int64_t>(activation_bytes);
    if (!profile.modules.empty()) module.producers = {static_cast<int>(profile.modules.size()) - 1};
    profile.modules.push_back(module);
  };
  const double embedding = static_cast<double>(shape.vocab) * h;
  add("embed", 0.0, embedding, 0.0, tp > 1 ? tp_all_reduce_s / 2 : 0.0);  // vocabulary-parallel: one all-reduce
  // Per layer: its matrix products (2 flops per parameter and token) and attention's two s x s products per head,
  // halved by the causal mask (flash attention skips the masked blocks). Activations kept for backward with flash
  // attention (Korthikanti et al. 2022, bf16): s h (10 + 24 / tp) bytes per sequence.
  const double layer_flops = 2.0 * shape.layer_parameters() * s + 2.0 * s * s * h;
  // Beside the products, memory-bound work: two norms, rotary embeddings, SwiGLU, two residual adds, each reading
  // and writing bf16 activations of width h (the MLP's of width ffn): about 16 passes over s x h and 6 over s x ffn.
  const double elementwise_bytes = bf16 * s * (16.0 * h + 6.0 * shape.ffn);
  for (int layer = 0; layer < shape.layers; ++layer) {
    add("layers." + std::to_string(layer), layer_flops, shape.layer_parameters(), s * h * (10.0 + 24.0 / tp),
        2.0 * tp_all_reduce_s, elementwise_bytes);
  }
  // The final norm, output layer and loss: its logits in fp32 kept for the backward.
  add("head", 2.0 * embedding * s, shape.tied_embeddings ? h : embedding + h, fp32 * s * shape.vocab / tp, 0.0);
  return profile;
}

std::vector<ClusterPrediction> plan_on_cluster(const DecoderShape& shape, const ClusterSpec& cluster, int global_batch) {
  if (global_batch < 1) throw ConfigError("plan_on_cluster: the global batch must be at least one sequence");
  Config base;
  base.global_batch_size = global_batch;
  base.memory_limit_mb = cluster.device_memory_gib * 1024.0;
  base.link_bandwidth_gbps = cluster.intra_node_gbps;
  base.source = "<cluster plan>";
  PlanningCosts costs;
  costs.latency_s = cluster.intra_node_latency_us * 1e-6;
  costs.p2p_bytes_per_s = costs.all_reduce_bytes_per_s = cluster.intra_node_gbps * 1e9;
  costs.ranks_per_node = cluster.devices_per_node;
  costs.inter_node_latency_s = cluster.inter_node_latency_us * 1e-6;
  costs.inter_node_bytes_per_s = cluster.inter_node_gbps * 1e9;
  // Adam's step reads and writes about 7 bytes of device memory per byte of fp32 parameters.
  costs.optimizer_s_per_byte = 7.0 / (cluster.memory_tbps * 1e12);
  // The decoder's profile prices its own tensor-parallel all-reduces (on the node's links), so it counts none.
  std::map<int, ModelProfile> by_degree;
  for (int tp : divisors(cluster.devices_per_node)) {
    if (shape.heads % tp != 0 || shape.kv_heads % tp != 0 || cluster.devices() % tp != 0) continue;
    by_degree[tp] = decoder_profile(shape, cluster, tp);
  }
  std::vector<ClusterPrediction> all;
  for (auto& prediction : plan_layouts(by_degree, base, cluster.devices(), costs)) {
    ClusterPrediction planned{std::move(prediction)};
    if (planned.prediction.rejected.empty() && planned.prediction.step_s > 0) {
      const double tokens_per_s = static_cast<double>(global_batch) * shape.sequence / planned.prediction.step_s;
      planned.tokens_per_s_per_device = tokens_per_s / cluster.devices();
      planned.mfu = planned.tokens_per_s_per_device * shape.flops_per_token() / (cluster.peak_tflops * 1e12);
    }
    planned.prediction.timeline_svg.clear();  // not what this report shows
    all.push_back(std::move(planned));
  }
  std::stable_sort(all.begin(), all.end(), [](const ClusterPrediction& a, const ClusterPrediction& b) {
    if (a.prediction.rejected.empty() != b.prediction.rejected.empty()) return a.prediction.rejected.empty();
    return a.prediction.step_s < b.prediction.step_s;
  });
  return all;
}

std::string cluster_report(const std::vector<ClusterPrediction>& predictions, const DecoderShape& shape,
                           const ClusterSpec& cluster, int global_batch, int shown) {
  std::ostringstream text;
  char line[320];
  std::snprintf(line, sizeof line,
                "%s (%.2fB parameters, %d layers, d %d, sequence %d) on %d x %d devices (%.0f GiB, %.0f TFLOP/s at "
                "%.0f%%), global batch %d sequences (%.2fM tokens)\n",
                shape.name.c_str(), shape.parameters() / 1e9, shape.layers, shape.hidden, shape.sequence,
                cluster.nodes, cluster.devices_per_node, cluster.device_memory_gib, cluster.peak_tflops,
                cluster.compute_efficiency * 100, global_batch, global_batch * static_cast<double>(shape.sequence) / 1e6);
  text << line;
  std::snprintf(line, sizeof line, "%-4s %-56s %10s %12s %6s %8s %10s\n", "", "layout", "step (s)", "tokens/s/dev",
                "MFU", "bubble", "GiB/dev");
  text << line;
  int listed = 0, rejected = 0;
  for (const auto& planned : predictions) {
    const auto& prediction = planned.prediction;
    if (!prediction.rejected.empty()) {
      ++rejected;
      continue;
    }
    if (listed++ >= shown) continue;
    std::snprintf(line, sizeof line, "%-4d %-56s %10.3f %12.0f %5.1f%% %7.1f%% %10.1f\n", listed,
                  prediction.layout.describe().c_str(), prediction.step_s, planned.tokens_per_s_per_device,
                  planned.mfu * 100, prediction.bubble_fraction * 100, prediction.peak_memory_mib() / 1024.0);
    text << line;
  }
  if (listed > shown) text << "     ... and " << listed - shown << " more that fit\n";
  text << rejected << " rejected (over " << cluster.device_memory_gib << " GiB a device, or not partitionable)\n";
  if (listed == 0) {
    text << "no layout fits\n";
    const LayoutPrediction* least = nullptr;
    for (const auto& planned : predictions) {
      const auto& prediction = planned.prediction;
      if (prediction.over_memory_limit() && (least == nullptr || prediction.peak_memory_mib() < least->peak_memory_mib())) {
        least = &prediction;
      }
    }
    if (least != nullptr) {
      std::snprintf(line, sizeof line, "the least a layout considered needs: %.1f GiB a device (%s)\n",
                    least->peak_memory_mib() / 1024.0, least->layout.describe().c_str());
      text << line;
    }
  } else {
    const auto& best = predictions.front();
    std::snprintf(line, sizeof line, "chosen: %s: %.0f tokens/s per device, MFU %.1f%%\n",
                  best.prediction.layout.describe().c_str(), best.tokens_per_s_per_device, best.mfu * 100);
    text << line;
  }
  return text.str();
}

}  // namespace smp
