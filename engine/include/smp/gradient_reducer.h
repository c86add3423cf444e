#pragma once
// Averages this rank's gradients over the data-parallel replicas, overlapped with the step's backward: parameters
// go into buckets (one dtype, up to a size), and a bucket's all-reduce is posted as soon as the last backward pass
// that adds to its parameters' gradients has accumulated them (an autograd post-accumulate-grad hook counts the
// passes), while the rest of the backward runs on.

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp/comm/communicator.h"

namespace smp {

class GradientReducer {
 public:
  // `accumulations[i]` is how many backward passes of one step add to parameters[i]'s gradient (microbatches x
  // the local stages that use it). Every replica of this pipeline rank builds the same reducer, so buckets are
  // posted in the same order everywhere, as collectives must be. The sum over `replicas` is divided by
  // `divisor`, or by their number when it is 0 (expert shards: summed over the replicas holding them, divided by
  // every replica, since each already holds the sum over the tokens of its expert-parallel group).
  GradientReducer(std::vector<at::Tensor> parameters, std::vector<int> accumulations, comm::Communicator& replicas,
                  std::int64_t bucket_bytes, int divisor = 0);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Before the step's backward passes: start counting.
  void arm();
  // After them: posts what no hook posted (parameters without a gradient this step get zeros), waits for every
  // bucket and leaves the replicas' mean in each .grad. Returns how many buckets the hooks posted during backward.
  int finish();
  int buckets() const { return static_cast<int>(buckets_.size()); }

  // Called by the hooks (from the autograd engine's thread).
  void accumulated(std::size_t parameter);

 private:
  struct Bucket {
    std::vector<std::size_t> members;  // parameter indices
    int waiting = 0;                   // members whose gradient is not final yet
    at::Tensor flat;
    std::unique_ptr<comm::Pending> reduction;
  };
  void post(Bucket& bucket);

  std::vector<at::Tensor> parameters_;
  std::vector<int> accumulations_;
  comm::Communicator& replicas_;
  double divisor_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::vector<int> seen_;  // this step's passes per parameter
  std::size_t next_to_post_ = 0;  // buckets before it are posted
  long long extra_pass_ = -1;     // a parameter that got more passes than expected, if any
  bool armed_ = false;
};

}  // namespace smp
