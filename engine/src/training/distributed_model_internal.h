#pragma once
// What more than one of the files of DistributedModel needs (engine/src/training/distributed_model*.cpp): the fp16 loss
// scale's schedule, set up by the constructor and followed by train_step.

namespace smp {

// Dynamic loss scaling for fp16 (the usual schedule): start high, halve on an overflow (and skip that step),
// double after this many steps without one.
constexpr double kInitialLossScale = 65536.0;
constexpr int kLossScaleGrowthInterval = 2000;

}  // namespace smp
