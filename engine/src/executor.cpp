#include "smp/executor.h"

#include <algorithm>

#include <chrono>
#include <climits>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "smp/comm/tensor_transfer.h"
#include "smp/errors.h"
#include "activation_checkpoint.h"
#include "split_backward.h"

namespace smp {
namespace {

using sched::ActionKind;

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

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct Stash {
  TensorsByStage inputs;        // by producer: leaves whose gradients are sent back
  TensorsByStage outputs;       // by consumer: graph roots for backward (empty while a checkpointed stage waits)
  bool outputs_ready = false;   // false after a checkpointed forward, until backward recomputes
  RandomState before_forward;   // checkpointed: what the forward drew from, so the recompute draws the same (dropout)
  at::Tensor loss;              // last stage only
  TensorsByStage output_grads;  // by consumer
  TensorsByStage input_grads;   // by producer, from I when backward is split
  WeightPass weight_pass;       // what I leaves for W
  bool backward_done = false;   // B, or W after I
  int gradient_sends_left = 0;
};

}  // namespace

PipelineExecutor::PipelineExecutor(sched::Schedule schedule, sched::StageGraph graph, comm::Communicator& pipeline,
                                   std::vector<int> checkpointed_stages)
    : schedule_(std::move(schedule)),
      graph_(std::move(graph)),
      pipeline_(pipeline),
      checkpointed_(static_cast<std::size_t>(graph_.num_stages()), false),
      last_stage_(graph_.num_stages() - 1) {
  if (pipeline_.size() != schedule_.num_ranks) {
    throw sched::ScheduleError("schedule has " + std::to_string(schedule_.num_ranks) + " pipeline ranks, group " +
                               pipeline_.name() + " has " + std::to_string(pipeline_.size()));
  }
  for (int stage : checkpointed_stages) checkpointed_.at(static_cast<std::size_t>(stage)) = true;
  std::set<std::pair<int, int>> channels;  // (sender, receiver) pipeline ranks
  for (int rank = 0; rank < schedule_.num_ranks; ++rank) {
    for (const auto& action : schedule_.ranks[rank]) {
      if (action.kind != ActionKind::SendForward && action.kind != ActionKind::SendBackward) continue;
      const int receiver = schedule_.stage_to_rank[action.peer_stage];
      if (receiver != rank) channels.insert({rank, receiver});
    }
  }
  pipeline_.connect({channels.begin(), channels.end()});
  if (pipeline_.in_order()) receive_order_ = sched::receives_in_send_order(schedule_, pipeline_.rank());
  delivered_by_receive_ = sched::sends_delivered_by_receive(schedule_, pipeline_.rank());

  // A forward-only schedule has no backward whose receives would prove this rank's sends delivered; with one stage
  // per rank nothing comes back at all (with virtual stages the activations come back round, see
  // sends_delivered_by_receive), so it would hold every microbatch's sent outputs to the end. Waiting for the oldest
  // send instead (which returns once the receiver reaches that receive) cannot deadlock when messages only go to
  // later ranks, this rank sends to one rank only, and that rank takes them in the order they were sent. A cycle of
  // waits would need a rank R waiting for a message this rank has not posted while this rank waits for R to take an
  // older one; R takes them in order, so it took that one already. Waits on sends alone only go up the ranks, so they cannot close a cycle either.
  // (With sends to two ranks, this rank could wait on one that waits, through a third, on its send to the other.)
  if (schedule_.forward_only) {
    const int me = pipeline_.rank();
    std::map<int, std::vector<std::pair<int, int>>> sent, taken;  // peer -> (producer stage, microbatch) in order
    bool upward = true;
    for (int rank = 0; rank < schedule_.num_ranks; ++rank) {
      for (const auto& action : schedule_.ranks[rank]) {
        const int peer = schedule_.stage_to_rank[action.peer_stage];
        if (action.kind == ActionKind::SendForward && peer != rank) {
          upward = upward && peer > rank;
          if (rank == me) sent[peer].emplace_back(action.stage, action.microbatch);
        } else if (action.kind == ActionKind::RecvForward && peer == me && rank != me) {
          taken[rank].emplace_back(action.peer_stage, action.microbatch);
        }
      }
    }
    wait_for_oldest_send_ = upward && sent.size() == 1 && sent == taken;
  }
}

ExecutorStats PipelineExecutor::run(const StageCallbacks& stages, const MicrobatchData& data) {
  const int me = pipeline_.rank();
  const int num_stages = schedule_.num_stages;
  const int microbatches = schedule_.num_microbatches;
  const auto& actions = schedule_.ranks[me];
  ExecutorStats stats;
  stats.events.reserve(actions.size());
  std::map<std::pair<int, int>, Stash> stash;  // (stage, microbatch)
  std::map<int, std::vector<at::Tensor>> local_mail;  // tag -> tensors between two stages of this rank
  at::Tensor loss_sum;  // on the losses' device, so that summing them does not wait for the GPU
  int stashed = 0;
  const bool evaluating = schedule_.forward_only;  // no graphs, nothing kept for a backward

  auto tag_of = [&](const sched::Action& action) {
    switch (action.kind) {
      case ActionKind::SendForward: return transfer_tag(Direction::Activation, action.stage, action.peer_stage, action.microbatch, num_stages, microbatches);
      case ActionKind::RecvForward: return transfer_tag(Direction::Activation, action.peer_stage, action.stage, action.microbatch, num_stages, microbatches);
      case ActionKind::SendBackward: return transfer_tag(Direction::Gradient, action.stage, action.peer_stage, action.microbatch, num_stages, microbatches);
      default: return transfer_tag(Direction::Gradient, action.peer_stage, action.stage, action.microbatch, num_stages, microbatches);
    }
  };
  auto where = [&](const sched::Action& action) {
    return sched::describe(action) + " on rank " + std::to_string(pipeline_.global_rank(me));
  };

  // Every receive is posted before the first compute, so a message is taken in as soon as its sender posts it
  // and the wait at the receive action covers only what compute could not hide.
  std::vector<std::unique_ptr<comm::IncomingTensors>> posted(actions.size());
  for (std::size_t i = 0; i < actions.size(); ++i) {
    const auto& action = actions[i];
    if (action.kind != ActionKind::RecvForward && action.kind != ActionKind::RecvBackward) continue;
    const int peer = schedule_.stage_to_rank[action.peer_stage];
    if (peer != me) posted[i] = std::make_unique<comm::IncomingTensors>(pipeline_, peer, tag_of(action), where(action));
  }

  // An in-order transport (NCCL) must take a peer's messages in the peer's send order: a message this rank needs
  // later is taken in early and kept. That never waits for more than the wanted message does: its sender sent
  // everything before it first.
  std::vector<std::vector<at::Tensor>> early(actions.size());
  std::vector<bool> taken_early(actions.size(), false);
  std::map<int, std::size_t> next_in_order;  // peer -> position in receive_order_
  auto receive_posted = [&](std::size_t index) {
    if (taken_early[index]) return std::move(early[index]);
    if (!receive_order_.empty()) {
      const int peer = schedule_.stage_to_rank[actions[index].peer_stage];
      const auto& order = receive_order_.at(peer);
      auto& next = next_in_order[peer];
      for (; next < order.size() && order[next] != index; ++next) {
        early[order[next]] = posted[order[next]]->wait();
        taken_early[order[next]] = true;
      }
      if (next == order.size()) throw sched::ScheduleError(where(actions[index]) + ": not in its sender's order");
      ++next;
    }
    return posted[index]->wait();
  };
  // A send's tensors go as soon as a receive proves it delivered (the peer took it before sending what arrived);
  // the transports cannot be asked without waiting (Gloo), or a send's header travels over Gloo (NCCL). Otherwise
  // they would live until the step's end, one sent output and one input gradient per microbatch beyond the
  // schedule's bound on the stash.
  std::map<std::size_t, std::unique_ptr<comm::Pending>> sends;  // by action index
  auto release_delivered = [&](std::size_t receive_index) {
    const auto proven = delivered_by_receive_.find(receive_index);
    if (proven == delivered_by_receive_.end()) return;
    for (std::size_t send_index : proven->second) {
      const auto found = sends.find(send_index);
      if (found == sends.end()) continue;
      found->second->wait();  // returns at once: the peer has the message
      sends.erase(found);
      ++stats.sends_released_early;
    }
  };
  auto receive = [&](std::size_t index) {
    if (posted[index]) {
      auto tensors = receive_posted(index);
      release_delivered(index);
      return tensors;
    }
    auto mail = local_mail.find(tag_of(actions[index]));
    if (mail == local_mail.end()) throw sched::ScheduleError(where(actions[index]) + ": local message missing");
    auto tensors = std::move(mail->second);
    local_mail.erase(mail);
    return tensors;
  };
  auto send = [&](std::size_t index, std::vector<at::Tensor> tensors) {
    const sched::Action& action = actions[index];
    const int peer = schedule_.stage_to_rank[action.peer_stage];
    if (peer == me) {
      local_mail[tag_of(action)] = std::move(tensors);
    } else {
      // Evaluation: one send in flight while the next output is computed, the older ones waited for.
      constexpr std::size_t kEvaluationSendsHeld = 2;
      while (wait_for_oldest_send_ && sends.size() >= kEvaluationSendsHeld) {
        sends.begin()->second->wait();
        sends.erase(sends.begin());
        ++stats.sends_released_early;
      }
      sends[index] = comm::send_tensors(pipeline_, tensors, peer, tag_of(action), where(action));
      ++stats.sends_posted;
      stats.peak_sends_held = std::max(stats.peak_sends_held, static_cast<int>(sends.size()));
    }
  };
  // Kept outputs go straight into one tensor for the replica's batch, allocated when the first arrives: no list of
  // them to concatenate (which would hold them twice at the end).
  const bool keep_outputs = data.keep_outputs && schedule_.stage_to_rank[last_stage_] == me;
  auto keep_output = [&](int microbatch, std::size_t which, const at::Tensor& output) {
    if (stats.outputs.size() <= which) stats.outputs.resize(which + 1);
    at::Tensor& kept = stats.outputs[which];
    // A 0-dim output (a per-microbatch metric) is one row.
    const at::Tensor value = output.dim() == 0 ? output.detach().reshape({1}) : output.detach();
    const int64_t rows = value.size(0);
    if (!kept.defined()) {
      std::vector<int64_t> sizes = value.sizes().vec();
      sizes[0] = rows * microbatches;
      kept = at::empty(sizes, value.options());
    }
    if (kept.dim() != value.dim() || kept.size(0) != rows * microbatches ||
        kept.sizes().slice(1) != value.sizes().slice(1)) {
      throw ModelError("the model's output " + std::to_string(which) + " differs in shape between microbatches (" +
                       c10::str(kept.sizes()) + " for all, " + c10::str(value.sizes()) + " for microbatch " +
                       std::to_string(microbatch) + "), so keep_outputs cannot join them");
    }
    kept.narrow(0, rows * microbatch, rows).copy_(value);
  };
  // recompute: the backward of a checkpointed stage running its forward again, whose output was kept already.
  auto run_forward = [&](int stage, int microbatch, Stash& entry, bool recompute) {
    auto produced = stages.forward(stage, data.inputs.at(microbatch), entry.inputs);
    entry.outputs = std::move(produced.to_consumers);
    entry.outputs_ready = true;
    if (stage == last_stage_) {
      if (produced.model_outputs.empty()) {
        throw sched::ScheduleError("the last stage (" + std::to_string(stage) + ") did not produce the model's output");
      }
      if (keep_outputs && !recompute) {
        for (std::size_t i = 0; i < produced.model_outputs.size(); ++i) {
          keep_output(microbatch, i, produced.model_outputs[i]);
        }
      }
      const at::Tensor target = data.targets.empty() ? at::Tensor() : data.targets.at(microbatch);
      entry.loss = data.loss(produced.model_outputs, target) * (data.loss_scale / static_cast<double>(microbatches));
    }
  };
  // The roots of this stage's backward and the gradients flowing into them.
  auto backward_roots = [&](int stage, int microbatch, Stash& entry) {
    if (!entry.outputs_ready) {  // checkpointed: rebuild the graph first
      const RecomputeScope same_as_first_run(entry.before_forward,
                                             stages.buffers ? stages.buffers(stage) : std::vector<at::Tensor>{},
                                             pipeline_.device());
      c10::AutoGradMode enable_grad(true);
      run_forward(stage, microbatch, entry, /*recompute=*/true);
    }
    std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> roots;
    if (entry.loss.defined()) {
      roots.first.push_back(entry.loss);
      roots.second.push_back(at::ones_like(entry.loss));
    }
    // A tensor sent to several consumers is a root once per consumer; autograd sums what flows into it.
    for (const auto& [consumer, outputs] : entry.outputs) {
      const auto& grads = entry.output_grads.at(consumer);
      for (std::size_t i = 0; i < outputs.size(); ++i) {
        if (!outputs[i].requires_grad()) continue;
        roots.first.push_back(outputs[i]);
        // Transfers travel on the group's device: an output a module left elsewhere (a CPU tensor in a GPU job)
        // gets its gradient back there.
        roots.second.push_back(grads.at(i).to(outputs[i].device()));
      }
    }
    return roots;
  };
  auto finish_backward = [&](int stage, int microbatch, Stash& entry) {
    entry.backward_done = true;
    entry.outputs.clear();
    entry.outputs_ready = false;
    entry.output_grads.clear();
    entry.loss = at::Tensor();
    --stashed;
    if (entry.gradient_sends_left == 0) stash.erase({stage, microbatch});
  };

  for (std::size_t index = 0; index < actions.size(); ++index) {
    const auto& action = actions[index];
    const int stage = action.stage, microbatch = action.microbatch;
    auto& entry = stash[{stage, microbatch}];
    TimelineEvent event{sched::to_string(action.kind), stage, microbatch, now_us(), 0.0, action.peer_stage};
    switch (action.kind) {
      case ActionKind::RecvForward: {
        auto& received = entry.inputs[action.peer_stage];
        for (auto& tensor : receive(index)) {
          // A fresh leaf: backward of this stage stops here and leaves the input gradient behind.
          tensor = tensor.detach();
          if (at::isFloatingType(tensor.scalar_type()) && !evaluating) tensor.requires_grad_(true);
          received.push_back(tensor);
        }
        break;
      }
      case ActionKind::Forward: {
        entry.gradient_sends_left = static_cast<int>(graph_.producers_of(stage).size());
        const bool recomputed_later = checkpointed_[stage] && !evaluating;
        std::vector<uint32_t> input_versions;
        const ModelInputs& model_inputs = data.inputs.at(microbatch);
        if (recomputed_later) {
          entry.before_forward = RandomState::capture(pipeline_.device());
          for (const auto& [producer, tensors] : entry.inputs) {
            for (const auto& tensor : tensors) input_versions.push_back(tensor._version());
          }
          for (const auto& input : model_inputs) input_versions.push_back(input.defined() ? input._version() : 0);
        }
        {
          c10::AutoGradMode grad_mode(!checkpointed_[stage] && !evaluating);
          run_forward(stage, microbatch, entry, /*recompute=*/false);
        }
        if (recomputed_later) {
          // Without a graph nothing stops the stage's first module from writing into what it received, and the
          // recompute would then start from the changed values.
          const auto refuse = [&](const std::string& what) {
            throw ModelError("stage " + std::to_string(stage) + " modifies " + what + " in place (an in-place "
                             "first operation?), so it cannot be checkpointed; make that operation out of place or "
                             "leave the stage out of \"activation_checkpointing\"");
          };
          std::size_t next = 0;
          for (const auto& [producer, tensors] : entry.inputs) {
            for (const auto& tensor : tensors) {
              if (tensor._version() != input_versions[next++]) {
                refuse("what it receives from stage " + std::to_string(producer));
              }
            }
          }
          for (const auto& input : model_inputs) {
            if (input.defined() && input._version() != input_versions[next]) refuse("a model input");
            ++next;
          }
        }
        if (evaluating) {
          // Nothing waits for a backward: the outputs live until they are sent, the rest goes now.
          if (entry.loss.defined()) {
            const at::Tensor loss = entry.loss.to(at::kDouble) / data.loss_scale;
            loss_sum = loss_sum.defined() ? loss_sum + loss : loss;
            stats.has_loss = true;
          }
          entry.inputs.clear();
          entry.loss = at::Tensor();
          if (entry.outputs.empty()) stash.erase({stage, microbatch});
          break;
        }
        if (entry.loss.defined()) {
          const at::Tensor loss = entry.loss.detach().to(at::kDouble) / data.loss_scale;
          loss_sum = loss_sum.defined() ? loss_sum + loss : loss;
          stats.has_loss = true;
        }
        // A checkpointed stage ran without a graph: its outputs are only sent on, its loss only counted; backward
        // recomputes both from the inputs.
        if (checkpointed_[stage]) {
          entry.loss = at::Tensor();
          entry.outputs_ready = false;
        }
        stats.peak_stashed_microbatches = std::max(stats.peak_stashed_microbatches, ++stashed);
        break;
      }
      case ActionKind::SendForward: {
        std::vector<at::Tensor> payload;
        for (const auto& output : entry.outputs.at(action.peer_stage)) payload.push_back(output.detach());
        send(index, std::move(payload));
        // Without a graph the outputs are worth nothing after sending: backward recomputes them.
        if (!entry.outputs_ready || evaluating) entry.outputs.erase(action.peer_stage);
        if (evaluating && entry.outputs.empty()) stash.erase({stage, microbatch});
        break;
      }
      case ActionKind::RecvBackward:
        entry.output_grads[action.peer_stage] = receive(index);
        break;
      case ActionKind::Backward: {
        auto [roots, grads] = backward_roots(stage, microbatch, entry);
        if (!roots.empty()) torch::autograd::backward(roots, grads);
        finish_backward(stage, microbatch, entry);
        break;
      }
      case ActionKind::BackwardInput: {
        auto [roots, grads] = backward_roots(stage, microbatch, entry);
        std::vector<at::Tensor> inputs;
        for (const auto& [producer, tensors] : entry.inputs) inputs.insert(inputs.end(), tensors.begin(), tensors.end());
        // Input gradients only; W later runs what is left for the weights (split_backward.h).
        auto [input_grads, weight_pass] = WeightPass::run_input_pass(roots, grads, inputs, stages.parameters(stage));
        entry.input_grads.clear();
        std::size_t next = 0;
        for (const auto& [producer, tensors] : entry.inputs) {
          for (std::size_t i = 0; i < tensors.size(); ++i) entry.input_grads[producer].push_back(input_grads[next++]);
        }
        entry.weight_pass = std::move(weight_pass);
        entry.outputs.clear();
        entry.output_grads.clear();
        entry.loss = at::Tensor();
        break;
      }
      case ActionKind::BackwardWeight: {
        entry.weight_pass.run();
        finish_backward(stage, microbatch, entry);
        break;
      }
      case ActionKind::SendBackward: {
        std::vector<at::Tensor> grads;
        const auto split = entry.input_grads.find(action.peer_stage);
        if (split != entry.input_grads.end()) {
          grads = split->second;
        } else {
          for (const auto& input : entry.inputs.at(action.peer_stage)) {
            grads.push_back(input.grad().defined() ? input.grad() : at::zeros_like(input));
          }
        }
        send(index, std::move(grads));
        if (--entry.gradient_sends_left == 0 && entry.backward_done) stash.erase({stage, microbatch});
        break;
      }
    }
    if (stages.synchronize) stages.synchronize();
    event.end_us = now_us();
    stats.events.push_back(std::move(event));
  }
  for (auto& [index, pending] : sends) pending->wait();
  stats.loss_sum = loss_sum.defined() ? loss_sum.item<double>() : 0.0;
  return stats;
}

}  // namespace smp
