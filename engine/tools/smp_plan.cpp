// smp_plan: the parallel layout of a decoder on a cluster that is not this machine, predicted by simulation.
//   smp_plan CLUSTER.json MODEL.json GLOBAL_BATCH [SHOWN]
// CLUSTER: nodes, devices_per_node, device_memory_gib, peak_tflops, compute_efficiency, memory_tbps,
// intra_node_gbps, inter_node_gbps, intra_node_latency_us, inter_node_latency_us (examples/clusters/).
// MODEL: name, layers, hidden, ffn, heads, kv_heads, vocab, sequence, tied_embeddings (examples/models/).
// GLOBAL_BATCH: sequences per step. Prints every tp x pp x dp layout that fits, ranked, and the choice.

#include <cstdio>
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

int run(int argc, char** argv) {
  if (argc < 4 || argc > 5) throw std::runtime_error("usage: smp_plan CLUSTER.json MODEL.json GLOBAL_BATCH [SHOWN]");
  const auto cluster = smp::ClusterSpec::from_json_text(read_file(argv[1]), argv[1]);
  const auto shape = smp::DecoderShape::from_json_text(read_file(argv[2]), argv[2]);
  const int global_batch = std::stoi(argv[3]);
  const int shown = argc == 5 ? std::stoi(argv[4]) : 10;
  const auto predictions = smp::plan_on_cluster(shape, cluster, global_batch);
  std::fputs(smp::cluster_report(predictions, shape, cluster, global_batch, shown).c_str(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
