#pragma once
// Synthetic module graphs with plausible profiled costs (seconds per microbatch, bytes), shared by the partition
// tests and the benchmark. Costs are jittered by a seeded generator, so a (size, seed) pair is reproducible.

#include <cstdint>

#include "smp/partitioner/graph_partition.h"

namespace smp::part {

// n identical nodes in a chain: the uniform split is optimal.
ModuleGraph uniform_chain(int num_nodes);

// n nodes in a chain with independently drawn costs (log-uniform over a decade).
ModuleGraph random_chain(int num_nodes, std::uint64_t seed = 1);

// A GPT-style chain: an embedding (large parameters and memory, moderate compute), `layers` near-identical blocks
// and an untied head (heavy compute and parameters); layers + 2 nodes.
ModuleGraph transformer_chain(int layers, std::uint64_t seed = 1);

// A stem, `blocks` residual blocks (two convolutions and an add, with a skip edge from the block input to the add)
// in four resolution groups (spatial size halves and channels double from group to group), and a head;
// 3 * blocks + 2 nodes.
ModuleGraph resnet_like(int blocks, std::uint64_t seed = 1);

// An encoder chain of `depth` levels, a bottleneck, a decoder chain of `depth` levels and an output head, with a
// skip edge from encoder level i to decoder level i; 2 * depth + 2 nodes. Levels past the fifth keep the fifth's
// resolution, as deep U-Nets repeat blocks at the coarsest scale.
ModuleGraph unet_like(int depth, std::uint64_t seed = 1);

// A connected DAG like a network with branches: every node after the first reads one to three earlier nodes, mostly
// recent ones, sometimes any.
ModuleGraph random_dag(int num_nodes, std::uint64_t seed);

}  // namespace smp::part
