#include "smp/gradient_reducer.h"

#include <map>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/util/StringUtil.h>

#include "smp/errors.h"

namespace smp {
namespace {

class CountingHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  CountingHook(GradientReducer& reducer, std::size_t parameter) : reducer_(reducer), parameter_(parameter) {}
  void operator()(const torch::autograd::Variable& /*tensor*/) override { reducer_.accumulated(parameter_); }

 private:
  GradientReducer& reducer_;
  std::size_t parameter_;
};

}  // namespace

GradientReducer::GradientReducer(std::vector<at::Tensor> parameters, std::vector<int> accumulations,
                                 comm::Communicator& replicas, std::int64_t bucket_bytes, int divisor)
    : parameters_(std::move(parameters)),
      accumulations_(std::move(accumulations)),
      replicas_(replicas),
      divisor_(divisor > 0 ? divisor : replicas.size()),
      bucket_of_(parameters_.size()),
      seen_(parameters_.size(), 0) {
  // Backward produces gradients roughly in reverse parameter order: buckets follow it, so the first bucket fills
  // early in the last backward pass.
  std::map<at::ScalarType, std::size_t> open;  // dtype -> bucket being filled
  std::vector<std::int64_t> bytes;
  for (std::size_t i = parameters_.size(); i-- > 0;) {
    const at::Tensor& parameter = parameters_[i];
    auto found = open.find(parameter.scalar_type());
    if (found == open.end() || bytes[found->second] >= bucket_bytes) {
      open[parameter.scalar_type()] = buckets_.size();
      found = open.find(parameter.scalar_type());
      buckets_.emplace_back();
      bytes.push_back(0);
    }
    buckets_[found->second].members.push_back(i);
    bytes[found->second] += static_cast<std::int64_t>(parameter.nbytes());
    bucket_of_[i] = found->second;
  }
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(parameters_[i], std::make_unique<CountingHook>(*this, i));
  }
}

GradientReducer::~GradientReducer() {
  for (const auto& parameter : parameters_) torch::autograd::impl::set_post_acc_grad_hooks(parameter, nullptr);
}

void GradientReducer::arm() {
  std::fill(seen_.begin(), seen_.end(), 0);
  for (auto& bucket : buckets_) {
    bucket.waiting = static_cast<int>(bucket.members.size());
    bucket.flat = at::Tensor();
    bucket.reduction.reset();
  }
  next_to_post_ = 0;
  extra_pass_ = -1;
  armed_ = true;
}

void GradientReducer::accumulated(std::size_t parameter) {
  if (!armed_) return;  // a backward outside a training step (e.g. profiling)
  const int seen = ++seen_[parameter];
  if (seen > accumulations_[parameter]) {
    extra_pass_ = static_cast<long long>(parameter);  // its bucket went out without this pass: finish() says so
    return;
  }
  if (seen != accumulations_[parameter]) return;
  --buckets_[bucket_of_[parameter]].waiting;
  // Collectives must be posted in the same order on every replica: bucket order, each as soon as it and all before
  // it are complete, whatever order the hooks complete them in.
  while (next_to_post_ < buckets_.size() && buckets_[next_to_post_].waiting == 0) post(buckets_[next_to_post_++]);
}

void GradientReducer::post(Bucket& bucket) {
  std::vector<at::Tensor> pieces;
  // After the gradients, one count per member: how many replicas had a gradient for it. None anywhere (a parameter
  // the step did not use) leaves .grad undefined, as a backward pass does, so that the optimizer skips it.
  std::vector<float> has_gradient;
  for (std::size_t member : bucket.members) {
    at::Tensor& parameter = parameters_[member];
    has_gradient.push_back(parameter.grad().defined() ? 1.0f : 0.0f);
    if (!parameter.grad().defined()) parameter.mutable_grad() = at::zeros_like(parameter);
    if (parameter.grad().is_sparse()) {
      throw ModelError("a parameter of shape " + c10::str(parameter.sizes()) + " has a sparse gradient (an " +
                       "Embedding built with sparse=True): data-parallel replicas average dense gradients; build " +
                       "it with sparse=False");
    }
    pieces.push_back(parameter.grad().reshape({-1}));
  }
  const at::Tensor& first = parameters_[bucket.members.front()];
  pieces.push_back(at::tensor(has_gradient).to(first.device(), first.scalar_type()));
  bucket.flat = at::cat(pieces);
  if (replicas_.size() > 1) bucket.reduction = replicas_.iall_reduce_sum(bucket.flat);
}

int GradientReducer::finish() {
  armed_ = false;
  const int posted_during_backward = static_cast<int>(next_to_post_);
  // Buckets that backward did not complete (a parameter without a gradient this step), still in bucket order.
  while (next_to_post_ < buckets_.size()) post(buckets_[next_to_post_++]);
  for (auto& bucket : buckets_) {
    if (bucket.reduction) bucket.reduction->wait();
    const auto members = static_cast<std::int64_t>(bucket.members.size());
    const at::Tensor with_gradient =
        bucket.flat.narrow(0, bucket.flat.numel() - members, members).to(at::kCPU, at::kFloat).contiguous();
    const float* replicas_with_gradient = with_gradient.data_ptr<float>();
    bucket.flat.div_(divisor_);
    std::int64_t offset = 0;
    for (std::size_t index = 0; index < bucket.members.size(); ++index) {
      at::Tensor& parameter = parameters_[bucket.members[index]];
      at::Tensor grad = parameter.grad();
      const std::int64_t count = grad.numel();
      if (replicas_with_gradient[index] == 0.0f) {
        parameter.mutable_grad() = at::Tensor();
      } else {
        grad.copy_(bucket.flat.narrow(0, offset, count).view_as(grad));
      }
      offset += count;
    }
    bucket.flat = at::Tensor();
    bucket.reduction.reset();
  }
  if (extra_pass_ >= 0) {
    throw std::logic_error("gradient reduction: parameter #" + std::to_string(extra_pass_) +
                           " received more backward passes than the schedule has (" +
                           std::to_string(accumulations_[static_cast<std::size_t>(extra_pass_)]) +
                           "); its bucket was averaged before the last one");
  }
  return posted_during_backward;
}

}  // namespace smp
