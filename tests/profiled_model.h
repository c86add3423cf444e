#pragma once
// The model the profiler tests (CPU and GPU) measure: what each module keeps for backward is known exactly.

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "smp/graph_model.h"

namespace smp_test {

// "linear" (16 -> width) saves its input and weight: nothing new beyond its output. "linear_gelu" (width -> width,
// then GELU) keeps GELU's input, the inner linear's output: batch x width floats beyond its output.
inline smp::GraphModel linear_then_gelu(int64_t width) {
  smp::GraphModel model("x");
  model.add("linear", torch::nn::Linear(16, width), {"x"});
  torch::nn::Sequential linear_gelu(torch::nn::Linear(width, width), torch::nn::GELU());
  model.add("linear_gelu", linear_gelu.ptr(),
            [linear_gelu](const std::vector<at::Tensor>& in) mutable { return linear_gelu->forward(in[0]); }, {"linear"});
  return model;
}

}  // namespace smp_test
