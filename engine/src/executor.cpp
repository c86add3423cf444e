#include "smp/executor.h"

#include <climits>
#include <map>
#include <memory>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <c10/core/GradMode.h>

#include "smp/comm/tensor_transfer.h"

namespace smp {
namespace {

enum class Direction { Activation = 0, Gradient = 1 };

// Every (direction, producer stage, consumer stage, microbatch) has its own tag range, so messages can never be
// matched to the wrong receive, whatever the order the schedule posts them in.
int transfer_tag(Direction direction, int from_stage, int to_stage, int microbatch, int stages, int microbatches) {
  const long long index =
      ((static_cast<long long>(direction) * stages + from_stage) * stages + to_stage) * microbatches + microbatch;
  const long long tag = index * comm::kTagsPerTransfer;
  if (tag > INT_MAX - comm::kTagsPerTransfer) {
    throw comm::CommError("too many stages x microbatches (" + std::to_string(stages) + " x " +
                          std::to_string(microbatches) + ") for transfer tags");
  }
  return static_cast<int>(tag);
}

struct Stash {
  std::vector<at::Tensor> inputs;   // leaves whose .grad is sent back
  std::vector<at::Tensor> outputs;  // graph roots for backward
  at::Tensor loss;                  // last stage only
  std::map<int, std::vector<at::Tensor>> output_grads;  // by consumer stage
  int gradient_sends_left = 0;      // the entry is dropped once every producer has its gradients
};

}  // namespace

PipelineExecutor::PipelineExecutor(sched::Schedule schedule, sched::StageGraph graph, comm::Communicator& pipeline)
    : schedule_(std::move(schedule)), graph_(std::move(graph)), pipeline_(pipeline), last_stage_(graph_.num_stages() - 1) {
  if (pipeline_.size() != schedule_.num_ranks) {
    throw sched::ScheduleError("schedule has " + std::to_string(schedule_.num_ranks) + " pipeline ranks, group " +
                               pipeline_.name() + " has " + std::to_string(pipeline_.size()));
  }
}

ExecutorStats PipelineExecutor::run(const StageForward& forward, const MicrobatchData& data) {
  const int me = pipeline_.rank();
  const int stages = schedule_.num_stages;
  const int microbatches = schedule_.num_microbatches;
  ExecutorStats stats;
  std::map<std::pair<int, int>, Stash> stash;  // (stage, microbatch)
  std::map<int, std::vector<at::Tensor>> local_mail;  // tag -> tensors between stages of this rank
  std::vector<std::unique_ptr<comm::Pending>> sends;
  at::Tensor loss_sum = at::zeros({}, at::kDouble);

  auto describe = [](const sched::Action& action) { return sched::describe(action); };
  auto receive = [&](Direction direction, int from_stage, int to_stage, int microbatch, const sched::Action& action) {
    const int tag = transfer_tag(direction, from_stage, to_stage, microbatch, stages, microbatches);
    const int peer = schedule_.stage_to_rank[from_stage];
    if (peer == me) {
      auto mail = local_mail.find(tag);
      if (mail == local_mail.end()) throw sched::ScheduleError(describe(action) + ": local message missing");
      auto tensors = std::move(mail->second);
      local_mail.erase(mail);
      return tensors;
    }
    comm::IncomingTensors incoming(pipeline_, peer, tag, describe(action) + " on rank " + std::to_string(pipeline_.global_rank(me)));
    return incoming.wait();
  };
  auto send = [&](Direction direction, int from_stage, int to_stage, int microbatch, std::vector<at::Tensor> tensors,
                  const sched::Action& action) {
    const int tag = transfer_tag(direction, from_stage, to_stage, microbatch, stages, microbatches);
    const int peer = schedule_.stage_to_rank[to_stage];
    if (peer == me) {
      local_mail[tag] = std::move(tensors);
      return;
    }
    sends.push_back(comm::send_tensors(pipeline_, tensors, peer, tag, describe(action)));
  };
  auto run_backward = [&](Stash& entry) {
    if (entry.loss.defined()) {
      entry.loss.backward();
      return;
    }
    std::vector<at::Tensor> roots, grads;
    for (std::size_t i = 0; i < entry.outputs.size(); ++i) {
      if (!entry.outputs[i].requires_grad()) continue;
      at::Tensor grad;
      for (const auto& [consumer, received] : entry.output_grads) {
        grad = grad.defined() ? grad + received.at(i) : received.at(i);
      }
      roots.push_back(entry.outputs[i]);
      grads.push_back(grad);
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
  };

  int stashed = 0;
  for (const auto& action : schedule_.ranks[me]) {
    const int stage = action.stage, microbatch = action.microbatch;
    auto& entry = stash[{stage, microbatch}];
    switch (action.kind) {
      case sched::ActionKind::RecvForward: {
        auto received = receive(Direction::Activation, action.peer_stage, stage, microbatch, action);
        for (auto& tensor : received) {
          // A fresh leaf: backward of this stage stops here and leaves the input gradient in .grad.
          tensor = tensor.detach();
          if (at::isFloatingType(tensor.scalar_type())) tensor.requires_grad_(true);
          entry.inputs.push_back(tensor);
        }
        break;
      }
      case sched::ActionKind::Forward: {
        if (stage == 0) entry.inputs = {data.inputs.at(microbatch)};
        c10::AutoGradMode enable_grad(true);
        entry.outputs = forward(stage, entry.inputs);
        if (stage == last_stage_) {
          if (entry.outputs.size() != 1) {
            throw sched::ScheduleError("the last stage must return one output for the loss, it returned " +
                                       std::to_string(entry.outputs.size()));
          }
          entry.loss = data.loss(entry.outputs[0], data.targets.at(microbatch)) / static_cast<double>(microbatches);
          loss_sum += entry.loss.detach().to(at::kDouble);
          stats.has_loss = true;
        }
        stats.peak_stashed_microbatches = std::max(stats.peak_stashed_microbatches, ++stashed);
        break;
      }
      case sched::ActionKind::SendForward: {
        std::vector<at::Tensor> payload;
        for (const auto& output : entry.outputs) payload.push_back(output.detach());
        send(Direction::Activation, stage, action.peer_stage, microbatch, std::move(payload), action);
        break;
      }
      case sched::ActionKind::RecvBackward:
        entry.output_grads[action.peer_stage] =
            receive(Direction::Gradient, action.peer_stage, stage, microbatch, action);
        break;
      case sched::ActionKind::Backward:
        run_backward(entry);
        entry.outputs.clear();
        entry.output_grads.clear();
        entry.loss = at::Tensor();
        --stashed;
        entry.gradient_sends_left = static_cast<int>(graph_.producers_of(stage).size());
        if (entry.gradient_sends_left == 0) stash.erase({stage, microbatch});
        break;
      case sched::ActionKind::SendBackward: {
        std::vector<at::Tensor> grads;
        for (const auto& input : entry.inputs) {
          grads.push_back(input.grad().defined() ? input.grad() : at::zeros_like(input));
        }
        send(Direction::Gradient, stage, action.peer_stage, microbatch, std::move(grads), action);
        if (--entry.gradient_sends_left == 0) stash.erase({stage, microbatch});
        break;
      }
      case sched::ActionKind::BackwardInput:
      case sched::ActionKind::BackwardWeight:
        throw sched::ScheduleError(describe(action) + ": split backward is not supported by this engine yet");
    }
  }
  for (auto& pending : sends) pending->wait();
  stats.loss_sum = loss_sum.item<double>();
  return stats;
}

}  // namespace smp
