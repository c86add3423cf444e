#include "smp/partitioner/graph_generators.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

namespace smp::part {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kBytesPerParameter = 4;   // fp32 master weights
constexpr double kStateCopies = 4;         // weights, gradients, two Adam moments
constexpr double kActivationBytes = 2;     // bf16/fp16 activations
constexpr double kFlopsPerSecond = 150e12;

// Draws from the raw 64-bit stream rather than std::*_distribution, whose output differs between standard
// libraries, so that a seed names the same graph everywhere.
class Draw {
 public:
  explicit Draw(std::uint64_t seed) : engine_(seed) {}
  double unit() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double jitter(double value, double spread) { return value * (1 + spread * (2 * unit() - 1)); }
  double log_uniform(double low, double high) { return low * std::pow(high / low, unit()); }
  int below(int bound) { return static_cast<int>(unit() * bound); }

 private:
  std::mt19937_64 engine_;
};

int add_node(ModuleGraph& graph, std::string name, double compute_s, double parameter_bytes,
             double activation_bytes) {
  GraphNode node;
  node.name = std::move(name);
  node.compute_s = compute_s;
  node.memory_bytes = kStateCopies * parameter_bytes;
  node.parameter_bytes = parameter_bytes;
  node.activation_bytes = activation_bytes;
  node.recompute_s = compute_s / 3;  // the forward: a third of forward + backward (see training_seconds)
  graph.nodes.push_back(std::move(node));
  return static_cast<int>(graph.nodes.size()) - 1;
}

void add_edge(ModuleGraph& graph, int from, int to, double bytes) { graph.edges.push_back({from, to, bytes}); }

// Forward and backward of a matrix product: three times the forward's 2 * multiply-adds.
double training_seconds(double multiply_adds) { return 6 * multiply_adds / kFlopsPerSecond; }

}  // namespace

ModuleGraph uniform_chain(int num_nodes) {
  ModuleGraph graph;
  for (int i = 0; i < num_nodes; ++i) {
    add_node(graph, "layer_" + std::to_string(i), 1e-3, 16 * kMiB, 8 * kMiB);
    if (i > 0) add_edge(graph, i - 1, i, 8 * kMiB);
  }
  return graph;
}

ModuleGraph random_chain(int num_nodes, std::uint64_t seed) {
  Draw draw(seed);
  ModuleGraph graph;
  for (int i = 0; i < num_nodes; ++i) {
    const double compute_s = draw.log_uniform(0.2e-3, 2e-3);
    const double parameters = draw.log_uniform(1 * kMiB, 64 * kMiB);
    add_node(graph, "layer_" + std::to_string(i), compute_s, parameters, draw.log_uniform(4 * kMiB, 32 * kMiB));
    if (i > 0) add_edge(graph, i - 1, i, draw.log_uniform(1 * kMiB, 32 * kMiB));
  }
  return graph;
}

ModuleGraph transformer_chain(int layers, std::uint64_t seed) {
  // GPT with hidden size 2048 and a 50k vocabulary on microbatches of 2048 tokens.
  constexpr double hidden = 2048, vocabulary = 50257, tokens = 2048;
  const double hidden_state_bytes = tokens * hidden * kActivationBytes;
  Draw draw(seed);
  ModuleGraph graph;
  const double table_bytes = vocabulary * hidden * kBytesPerParameter;
  add_node(graph, "embedding", draw.jitter(0.4e-3, 0.05), table_bytes, hidden_state_bytes);
  const double block_parameters = 12 * hidden * hidden;
  // Attention and MLP keep about 34 hidden-state-sized tensors per block for the backward pass.
  const double block_activations = 34 * hidden_state_bytes;
  for (int layer = 0; layer < layers; ++layer) {
    const int block = add_node(graph, "block_" + std::to_string(layer),
                               draw.jitter(training_seconds(block_parameters * tokens), 0.03),
                               block_parameters * kBytesPerParameter, block_activations);
    add_edge(graph, block - 1, block, hidden_state_bytes);
  }
  const int head = add_node(graph, "head", draw.jitter(training_seconds(vocabulary * hidden * tokens), 0.05),
                            table_bytes, tokens * vocabulary * 4.0);  // fp32 logits for the loss
  add_edge(graph, head - 1, head, hidden_state_bytes);
  return graph;
}

ModuleGraph resnet_like(int blocks, std::uint64_t seed) {
  constexpr double batch = 32, stem_channels = 64, stem_side = 56;
  Draw draw(seed);
  ModuleGraph graph;
  auto feature_map_bytes = [&](double channels, double side) { return batch * channels * side * side * kActivationBytes; };
  double input_bytes = feature_map_bytes(stem_channels, stem_side);
  int input = add_node(graph, "stem", draw.jitter(0.4e-3, 0.1), 7 * 7 * 3 * stem_channels * kBytesPerParameter,
                       2 * input_bytes);
  double channels = stem_channels;
  for (int b = 0; b < blocks; ++b) {
    const int group = std::min(3, 4 * b / std::max(blocks, 1));
    channels = stem_channels * std::pow(2.0, group);
    const double side = stem_side / std::pow(2.0, group);
    const double map_bytes = feature_map_bytes(channels, side);
    const double conv_parameters = 9 * channels * channels;
    const double conv_seconds = training_seconds(conv_parameters * side * side * batch);
    const std::string suffix = "_" + std::to_string(b);
    // A convolution keeps its input and its batch-norm output for the backward pass.
    const int conv1 = add_node(graph, "conv1" + suffix, draw.jitter(conv_seconds, 0.1),
                               conv_parameters * kBytesPerParameter, 2 * map_bytes);
    const int conv2 = add_node(graph, "conv2" + suffix, draw.jitter(conv_seconds, 0.1),
                               conv_parameters * kBytesPerParameter, 2 * map_bytes);
    const int add = add_node(graph, "add" + suffix, draw.jitter(0.02e-3, 0.1), 0, map_bytes);
    add_edge(graph, input, conv1, input_bytes);
    add_edge(graph, conv1, conv2, map_bytes);
    add_edge(graph, conv2, add, map_bytes);
    add_edge(graph, input, add, input_bytes);
    input = add, input_bytes = map_bytes;
  }
  const int head = add_node(graph, "head", draw.jitter(0.05e-3, 0.1), channels * 1000 * kBytesPerParameter,
                            batch * 1000 * 4.0);
  add_edge(graph, input, head, input_bytes);
  return graph;
}

ModuleGraph unet_like(int depth, std::uint64_t seed) {
  constexpr double batch = 8, base_channels = 64, base_side = 256;
  constexpr int coarsest_level = 4;
  Draw draw(seed);
  ModuleGraph graph;
  auto channels_at = [&](int level) { return base_channels * std::pow(2.0, std::min(level, coarsest_level)); };
  auto side_at = [&](int level) { return base_side / std::pow(2.0, std::min(level, coarsest_level)); };
  auto map_bytes_at = [&](int level) {
    return batch * channels_at(level) * side_at(level) * side_at(level) * kActivationBytes;
  };
  // A level is two 3x3 convolutions; the decoder's also take the upsampled input and the skip (twice the
  // channels in) and an up-convolution, about 1.5 times the work.
  auto level_node = [&](const std::string& name, int level, double work) {
    const double parameters = work * 2 * 9 * channels_at(level) * channels_at(level);
    const double seconds = training_seconds(parameters * side_at(level) * side_at(level) * batch);
    return add_node(graph, name, draw.jitter(seconds, 0.1), parameters * kBytesPerParameter,
                    work * 4 * map_bytes_at(level));
  };
  std::vector<int> encoder(depth);
  for (int level = 0; level < depth; ++level) {
    encoder[level] = level_node("encoder_" + std::to_string(level), level, 1.0);
    if (level > 0) add_edge(graph, encoder[level - 1], encoder[level], map_bytes_at(level - 1));
  }
  int previous = level_node("bottleneck", depth, 1.0);
  if (depth > 0) add_edge(graph, encoder[depth - 1], previous, map_bytes_at(depth - 1));
  int previous_level = depth;
  for (int level = depth - 1; level >= 0; --level) {
    const int decoder = level_node("decoder_" + std::to_string(level), level, 1.5);
    add_edge(graph, previous, decoder, map_bytes_at(previous_level));
    add_edge(graph, encoder[level], decoder, map_bytes_at(level));
    previous = decoder, previous_level = level;
  }
  const int head = add_node(graph, "head", draw.jitter(0.1e-3, 0.1), base_channels * 2 * kBytesPerParameter,
                            batch * 2 * base_side * base_side * 4.0);
  add_edge(graph, previous, head, map_bytes_at(previous_level));
  return graph;
}

ModuleGraph random_dag(int num_nodes, std::uint64_t seed) {
  constexpr int kRecentWindow = 5;
  Draw draw(seed);
  ModuleGraph graph;
  std::vector<double> output_bytes;
  for (int node = 0; node < num_nodes; ++node) {
    add_node(graph, "node_" + std::to_string(node), draw.log_uniform(0.1e-3, 3e-3),
             draw.log_uniform(0.1 * kMiB, 50 * kMiB), draw.log_uniform(2 * kMiB, 64 * kMiB));
    output_bytes.push_back(draw.log_uniform(0.5 * kMiB, 64 * kMiB));
    if (node == 0) continue;
    const int inputs = 1 + (draw.unit() < 0.35 ? 1 : 0) + (draw.unit() < 0.1 ? 1 : 0);
    std::vector<int> sources;
    for (int i = 0; i < inputs; ++i) {
      const bool recent = draw.unit() < 0.85;
      const int first = recent ? std::max(0, node - kRecentWindow) : 0;
      sources.push_back(first + draw.below(node - first));
    }
    std::sort(sources.begin(), sources.end());
    sources.erase(std::unique(sources.begin(), sources.end()), sources.end());
    for (int source : sources) add_edge(graph, source, node, output_bytes[source]);
  }
  return graph;
}

}  // namespace smp::part
