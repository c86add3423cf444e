// smp_plan: the parallel layout of a decoder on a cluster that is not this machine, predicted by simulation.
//   smp_plan CLUSTER.json MODEL.json GLOBAL_BATCH [SHOWN]
// CLUSTER: nodes, devices_per_node, device_memory_gib, peak_tflops, compute_efficiency, memory_tbps,
// intra_node_gbps, inter_node_gbps, intra_node_latency_us, inter_node_latency_us (examples/clusters/).
// MODEL: name, layers, hidden, ffn, heads, kv_heads, vocab, sequence, tied_embeddings (examples/models/).
// GLOBAL_BATCH: sequences per step. Prints every tp x pp x dp layout that fits, ranked, and the choice.

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "smp/cluster_plan.h"
#include "smp/config.h"
#include "smp/main.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw smp::ConfigError(path + ": cannot be read");
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// The whole argument as a whole number in [least, most], or a one-line error naming it ("8x" and "1.5" are not).
int whole_number(const char* text, const char* what, int least, int most) {
  int value = 0;
  const char* end = text + std::strlen(text);
  const auto [stopped, error] = std::from_chars(text, end, value);
  if (error != std::errc() || stopped != end || value < least || value > most) {
    throw smp::ConfigError(std::string(what) + " \"" + text + "\": expected a whole number from " +
                           std::to_string(least) + " to " + std::to_string(most));
  }
  return value;
}

constexpr const char* kUsage =
    "usage: smp_plan CLUSTER.json MODEL.json GLOBAL_BATCH [SHOWN]\n"
    "Predicts, by simulation, every tp x pp x dp layout of a decoder that fits the cluster, ranked, and the choice.\n"
    "  CLUSTER.json: nodes, devices_per_node, device_memory_gib, peak_tflops, compute_efficiency, memory_tbps,\n"
    "                intra_node_gbps, inter_node_gbps, intra_node_latency_us, inter_node_latency_us\n"
    "  MODEL.json:   name, layers, hidden, ffn, heads, kv_heads, vocab, sequence, tied_embeddings\n"
    "  GLOBAL_BATCH: sequences per step; SHOWN: how many layouts to print (10)\n"
    "Examples in the source tree's examples/clusters/ and examples/models/.";

int run(int argc, char** argv) {
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("%s\n", kUsage);
    return 0;
  }
  if (argc < 4 || argc > 5) throw std::runtime_error(kUsage);
  const auto cluster = smp::ClusterSpec::from_json_text(read_file(argv[1]), argv[1]);
  const auto shape = smp::DecoderShape::from_json_text(read_file(argv[2]), argv[2]);
  const int global_batch = whole_number(argv[3], "GLOBAL_BATCH", 1, 1 << 30);
  const int shown = argc == 5 ? whole_number(argv[4], "SHOWN", 0, 1 << 30) : 10;
  const auto predictions = smp::plan_on_cluster(shape, cluster, global_batch);
  std::fputs(smp::cluster_report(predictions, shape, cluster, global_batch, shown).c_str(), stdout);
  const bool fits = std::any_of(predictions.begin(), predictions.end(),
                                [](const smp::ClusterPrediction& p) { return p.prediction.rejected.empty(); });
  return fits ? 0 : 1;  // a script can tell a plan from none
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
