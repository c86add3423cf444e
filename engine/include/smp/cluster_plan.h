#pragma once
// Plans beyond this machine: a cluster described by its devices and links, and a decoder described by its shape,
// give every tp x pp x dp layout's predicted step, memory per device and throughput for 8 to 1,024 devices,
// without running there. The decoder's per-layer costs come from its arithmetic (matrix products at a fraction of
// the device's peak, Korthikanti et al.'s activation bytes for flash attention, Megatron's tensor-parallel
// all-reduces), then plan_layouts does the rest as it does for a profiled model. `smp_plan` prints the report.

#include <string>
#include <vector>

#include "smp/layout_plan.h"

namespace smp {

struct ClusterSpec {
  int nodes = 1;
  int devices_per_node = 8;
  double device_memory_gib = 80.0;
  double peak_tflops = 989.0;         // dense bf16 matrix products per device
  double compute_efficiency = 0.6;    // the fraction of peak the matrix products reach in training
  double memory_tbps = 3.35;          // device memory bandwidth: the optimizer's step is bound by it
  double intra_node_gbps = 450.0;     // per device and direction (NVLink)
  double inter_node_gbps = 50.0;      // per device and direction (400 Gb/s InfiniBand)
  double intra_node_latency_us = 5.0;
  double inter_node_latency_us = 10.0;
  int devices() const { return nodes * devices_per_node; }
  // Keys as the fields; unknown keys and bad values are ConfigErrors naming them.
  static ClusterSpec from_json_text(const std::string& text, const std::string& source);
};

// A Llama-shaped decoder: embedding, `layers` blocks (attention with grouped key-value heads, a gated MLP of
// width `ffn`), final norm and output layer, trained on sequences of `sequence` tokens in bf16 with fp32 master
// weights and Adam.
struct DecoderShape {
  std::string name = "decoder";
  int layers = 32, hidden = 4096, ffn = 14336, heads = 32, kv_heads = 8, vocab = 128256, sequence = 8192;
  bool tied_embeddings = false;
  double layer_parameters() const;
  double parameters() const;
  // Model FLOPs per token, forward and backward, by the convention throughput reports use (torchtitan, Megatron):
  // 6 x the parameters that multiply (all but the input embedding, a lookup; the output projection counts, tied or
  // not) + 12 x layers x hidden x sequence (attention counted without the causal mask's saving).
  double flops_per_token() const;
  static DecoderShape from_json_text(const std::string& text, const std::string& source);
};

struct ClusterPrediction {
  LayoutPrediction prediction;      // its layout carries tensor_parallel
  double tokens_per_s_per_device = 0.0;
  double mfu = 0.0;                 // model FLOPs per second over the devices' peak
};

// The decoder's modules on one sequence at tensor-parallel degree `tp`, as profile_graph would measure them on
// that device: compute at peak x efficiency (the causal mask halving attention's products), the tp all-reduces of
// each block (two forward, two backward), parameters in fp32 terms (the planner counts weights, gradients and
// Adam's two moments at 4 bytes each: 16 bytes a parameter for mixed precision's 18).
ModelProfile decoder_profile(const DecoderShape& shape, const ClusterSpec& cluster, int tp);

// Every tensor-parallel degree that divides the node's devices and the heads, with every layout plan_layouts
// considers for the rest of the devices; fitting ones first, fastest first. `global_batch` in sequences.
std::vector<ClusterPrediction> plan_on_cluster(const DecoderShape& shape, const ClusterSpec& cluster, int global_batch);

// The ranked table: layout, step, tokens/s per device, MFU, memory per device; the rejected; the choice.
std::string cluster_report(const std::vector<ClusterPrediction>& predictions, const DecoderShape& shape,
                           const ClusterSpec& cluster, int global_batch, int shown = 10);

}  // namespace smp
