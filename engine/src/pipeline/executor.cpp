#include "smp/executor.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <thread>
#include <climits>
#include <future>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "smp/comm/laned_communicator.h"
#include "smp/comm/tensor_transfer.h"
#include "smp/errors.h"
#include "pipeline/activation_checkpoint.h"
#include "core/program_call.h"
#include "pipeline/split_backward.h"

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

void emulate_slow_device(double busy_seconds, double factor) {
  if (factor > 1.0 && busy_seconds > 0.0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(busy_seconds * (factor - 1.0)));
  }
}

PipelineExecutor::PipelineExecutor(sched::Schedule schedule, sched::StageGraph graph, comm::Communicator& pipeline,
                                   std::vector<int> checkpointed_stages, bool overlap_forward_backward)
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
  if (overlap_forward_backward) overlapped_ = sched::overlapped_pairs(schedule_, pipeline_.rank());
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

// One run of a rank's action list: the step's state, and one small handler per action kind, dispatched from a table
// (as DeepSpeed's pipeline engine dispatches its instructions).
class PipelineExecutor::Step {
 public:
  Step(PipelineExecutor& executor, const StageCallbacks& stages, const MicrobatchData& data)
      : executor_(executor),
        schedule_(executor.schedule_),
        stages_(stages),
        data_(data),
        me_(executor.pipeline_.rank()),
        actions_(schedule_.ranks[me_]),
        evaluating_(schedule_.forward_only),
        keep_outputs_(data.keep_outputs && schedule_.stage_to_rank[executor.last_stage_] == me_),
        posted_(actions_.size()),
        early_(actions_.size()),
        taken_early_(actions_.size(), false) {
    stats_.events.reserve(actions_.size());
  }

  ExecutorStats run() {
    post_receives();
    for (std::size_t index = 0; index < actions_.size(); ++index) {
      const auto pair = executor_.overlapped_.find(index);
      if (pair == executor_.overlapped_.end()) {
        run_action(index);
      } else {
        run_overlapped(index, pair->second);
        index = pair->second.last;
      }
    }
    for (auto& [index, pending] : sends_) pending->wait();
    // On a GPU the transfers may still be in flight (their waits only ordered the compute stream after them).
    executor_.pipeline_.synchronize();
    stats_.loss_sum = loss_sum_.defined() ? loss_sum_.item<double>() : 0.0;
    join_uneven_outputs();
    return std::move(stats_);
  }

 private:
  using Handler = void (Step::*)(std::size_t index);
  // By ActionKind: F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B.
  static const std::array<Handler, 8> kHandlers;

  void run_action(std::size_t index) {
    const auto& action = actions_[index];
    TimelineEvent event{sched::to_string(action.kind), action.stage, action.microbatch, now_us(), 0.0,
                        action.peer_stage};
    (this->*kHandlers[static_cast<std::size_t>(action.kind)])(index);
    if (stages_.synchronize) stages_.synchronize();
    if (stages_.emulated_slowdown > 1.0 && sched::is_compute(action.kind)) {
      emulate_slow_device((now_us() - event.start_us) * 1e-6, stages_.emulated_slowdown);
    }
    event.end_us = now_us();
    stats_.events.push_back(std::move(event));
  }

  // The forward at `first` runs on a second thread, its in-compute collectives on their second communicators,
  // while this thread goes through the window (the backward beside it, its transfers); the held sends go once
  // the forward is done. The forward touches only its own stash entry, made here, and its loss and kept outputs.
  void run_overlapped(std::size_t first, const sched::OverlapWindow& window) {
    const auto& action = actions_[first];
    Stash& entry = entry_of(action);
    const ForwardCall call = prepare_forward(action, entry);
    TimelineEvent event{sched::to_string(action.kind), action.stage, action.microbatch, 0.0, 0.0, action.peer_stage,
                        /*second_lane=*/true};
    const at::ThreadLocalState caller_state;  // grad mode, autocast, dispatch keys as this thread has them
    auto forward = std::async(std::launch::async, [&, caller_state] {
      const at::ThreadLocalStateGuard same_state(caller_state);
      // A new thread's current GPU is device 0 whatever this rank's is: new tensors of the forward go to its own.
      c10::OptionalDeviceGuard same_device;
      if (!executor_.pipeline_.device().is_cpu()) same_device.reset_device(executor_.pipeline_.device());
      const comm::SecondLane own_collectives;
      event.start_us = now_us();
      compute_forward(action, entry, call);
      if (stages_.synchronize) stages_.synchronize();
      event.end_us = now_us();
    });
    try {
      auto held = window.held.begin();
      for (std::size_t index = first + 1; index <= window.last; ++index) {
        if (held != window.held.end() && *held == index) {
          ++held;
        } else {
          run_action(index);
        }
      }
    } catch (...) {
      forward.wait();  // it returns: its collectives end within the communicators' timeout
      throw;
    }
    forward.get();
    finish_forward(action, entry);
    stats_.events.push_back(std::move(event));
    ++stats_.forwards_overlapped;
    for (std::size_t index : window.held) run_action(index);
  }

  Stash& entry_of(const sched::Action& action) { return stash_[{action.stage, action.microbatch}]; }
  void drop(const sched::Action& action) { stash_.erase({action.stage, action.microbatch}); }

  // --- Handlers ---

  void receive_forward(std::size_t index) {
    const auto& action = actions_[index];
    auto& received = entry_of(action).inputs[action.peer_stage];
    for (auto& tensor : receive(index)) {
      // A fresh leaf: backward of this stage stops here and leaves the input gradient behind.
      tensor = tensor.detach();
      if (at::isFloatingType(tensor.scalar_type()) && !evaluating_) tensor.requires_grad_(true);
      received.push_back(tensor);
    }
  }

  void forward(std::size_t index) {
    const auto& action = actions_[index];
    Stash& entry = entry_of(action);
    const ForwardCall call = prepare_forward(action, entry);
    compute_forward(action, entry, call);
    finish_forward(action, entry);
  }

  struct ForwardCall {
    bool checkpointed = false;
    bool recomputed_later = false;
    std::vector<uint32_t> input_versions;  // recomputed later: what the inputs were before the forward
  };

  ForwardCall prepare_forward(const sched::Action& action, Stash& entry) {
    ForwardCall call;
    entry.gradient_sends_left = static_cast<int>(executor_.graph_.producers_of(action.stage).size());
    call.checkpointed = executor_.checkpointed_[action.stage];
    call.recomputed_later = call.checkpointed && !evaluating_;
    if (call.recomputed_later) {
      entry.before_forward = RandomState::capture(executor_.pipeline_.device());
      for (const auto& [producer, tensors] : entry.inputs) {
        for (const auto& tensor : tensors) call.input_versions.push_back(tensor._version());
      }
      for (const auto& input : data_.inputs.at(action.microbatch)) {
        call.input_versions.push_back(input.defined() ? input._version() : 0);
      }
    }
    return call;
  }

  void compute_forward(const sched::Action& action, Stash& entry, const ForwardCall& call) {
    {
      c10::AutoGradMode grad_mode(!call.checkpointed && !evaluating_);
      run_forward(action.stage, action.microbatch, entry, /*recompute=*/false);
    }
    if (call.recomputed_later) {
      refuse_changed_inputs(action.stage, entry, data_.inputs.at(action.microbatch), call.input_versions);
    }
  }

  void finish_forward(const sched::Action& action, Stash& entry) {
    const bool checkpointed = executor_.checkpointed_[action.stage];
    if (evaluating_) {
      // Nothing waits for a backward: the outputs live until they are sent, the rest goes now.
      if (entry.loss.defined()) add_loss(entry.loss);
      entry.inputs.clear();
      entry.loss = at::Tensor();
      if (entry.outputs.empty()) drop(action);
      return;
    }
    if (entry.loss.defined()) add_loss(entry.loss.detach());
    // A checkpointed stage ran without a graph: its outputs are only sent on, its loss only counted; backward
    // recomputes both from the inputs.
    if (checkpointed) {
      entry.loss = at::Tensor();
      entry.outputs_ready = false;
    }
    stats_.peak_stashed_microbatches = std::max(stats_.peak_stashed_microbatches, ++stashed_);
  }

  void send_forward(std::size_t index) {
    const auto& action = actions_[index];
    Stash& entry = entry_of(action);
    std::vector<at::Tensor> payload;
    for (const auto& output : entry.outputs.at(action.peer_stage)) payload.push_back(output.detach());
    send(index, std::move(payload));
    // Without a graph the outputs are worth nothing after sending: backward recomputes them.
    if (!entry.outputs_ready || evaluating_) entry.outputs.erase(action.peer_stage);
    if (evaluating_ && entry.outputs.empty()) drop(action);
  }

  void receive_backward(std::size_t index) {
    const auto& action = actions_[index];
    entry_of(action).output_grads[action.peer_stage] = receive(index);
  }

  void backward(std::size_t index) {
    const auto& action = actions_[index];
    Stash& entry = entry_of(action);
    auto [roots, grads] = backward_roots(action.stage, action.microbatch, entry);
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    finish_backward(action, entry);
  }

  void backward_input(std::size_t index) {
    const auto& action = actions_[index];
    Stash& entry = entry_of(action);
    auto [roots, grads] = backward_roots(action.stage, action.microbatch, entry);
    std::vector<at::Tensor> inputs;
    for (const auto& [producer, tensors] : entry.inputs) inputs.insert(inputs.end(), tensors.begin(), tensors.end());
    // Input gradients only; W later runs what is left for the weights (split_backward.h).
    auto [input_grads, weight_pass] =
        WeightPass::run_input_pass(roots, grads, inputs, stages_.parameters(action.stage));
    entry.input_grads.clear();
    std::size_t next = 0;
    for (const auto& [producer, tensors] : entry.inputs) {
      for (std::size_t i = 0; i < tensors.size(); ++i) entry.input_grads[producer].push_back(input_grads[next++]);
    }
    entry.weight_pass = std::move(weight_pass);
    entry.outputs.clear();
    entry.output_grads.clear();
    entry.loss = at::Tensor();
  }

  void backward_weight(std::size_t index) {
    const auto& action = actions_[index];
    Stash& entry = entry_of(action);
    entry.weight_pass.run();
    finish_backward(action, entry);
  }

  void send_backward(std::size_t index) {
    const auto& action = actions_[index];
    Stash& entry = entry_of(action);
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
    if (--entry.gradient_sends_left == 0 && entry.backward_done) drop(action);
  }

  // --- Compute ---

  void add_loss(const at::Tensor& scaled) {
    const at::Tensor loss = scaled.to(at::kDouble) / data_.loss_scale;
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + loss : loss;
    stats_.has_loss = true;
  }

  // Without a graph nothing stops the stage's first module from writing into what it received, and the recompute
  // would then start from the changed values.
  void refuse_changed_inputs(int stage, const Stash& entry, const ModelInputs& model_inputs,
                             const std::vector<uint32_t>& input_versions) const {
    const auto refuse = [&](const std::string& what) {
      throw ModelError("stage " + std::to_string(stage) + " modifies " + what + " in place (an in-place first "
                       "operation?), so it cannot be checkpointed; make that operation out of place or leave the "
                       "stage out of \"activation_checkpointing\"");
    };
    std::size_t next = 0;
    for (const auto& [producer, tensors] : entry.inputs) {
      for (const auto& tensor : tensors) {
        if (tensor._version() != input_versions[next++]) refuse("what it receives from stage " + std::to_string(producer));
      }
    }
    for (const auto& input : model_inputs) {
      if (input.defined() && input._version() != input_versions[next]) refuse("a model input");
      ++next;
    }
  }

  // Kept outputs go straight into one tensor for the replica's batch, allocated when the first arrives: no list of
  // them to concatenate (which would hold them twice at the end). Microbatches of unequal sizes have unequal rows
  // of output, placed only once all are known: those are joined at the end.
  void keep_output(int microbatch, std::size_t which, const at::Tensor& output) {
    const int microbatches = schedule_.num_microbatches;
    if (stats_.outputs.size() <= which) stats_.outputs.resize(which + 1);
    at::Tensor& kept = stats_.outputs[which];
    // A 0-dim output (a per-microbatch metric) is one row.
    const at::Tensor value = output.dim() == 0 ? output.detach().reshape({1}) : output.detach();
    if (data_.uneven) {
      if (uneven_outputs_.size() <= which) uneven_outputs_.resize(which + 1, std::vector<at::Tensor>(microbatches));
      uneven_outputs_[which][microbatch] = value;
      return;
    }
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
  }

  void join_uneven_outputs() {
    for (std::size_t which = 0; which < uneven_outputs_.size(); ++which) {
      const auto& pieces = uneven_outputs_[which];
      for (std::size_t m = 1; m < pieces.size(); ++m) {
        if (pieces[m].dim() != pieces[0].dim() || pieces[m].sizes().slice(1) != pieces[0].sizes().slice(1)) {
          throw ModelError("the model's output " + std::to_string(which) + " differs in shape between microbatches (" +
                           c10::str(pieces[0].sizes()) + " for microbatch 0, " + c10::str(pieces[m].sizes()) +
                           " for microbatch " + std::to_string(m) + "), so keep_outputs cannot join them");
        }
      }
      stats_.outputs[which] = at::cat(pieces);
    }
  }

  // recompute: the backward of a checkpointed stage running its forward again, whose output was kept already.
  void run_forward(int stage, int microbatch, Stash& entry, bool recompute) {
    auto produced = stages_.forward(stage, data_.inputs.at(microbatch), entry.inputs);
    entry.outputs = std::move(produced.to_consumers);
    entry.outputs_ready = true;
    if (stage != executor_.last_stage_) return;
    if (produced.model_outputs.empty()) {
      throw sched::ScheduleError("the last stage (" + std::to_string(stage) + ") did not produce the model's output");
    }
    if (keep_outputs_ && !recompute) {
      for (std::size_t i = 0; i < produced.model_outputs.size(); ++i) keep_output(microbatch, i, produced.model_outputs[i]);
    }
    const at::Tensor target = data_.targets.empty() ? at::Tensor() : data_.targets.at(microbatch);
    at::Tensor loss;
    try {
      loss = data_.loss(produced.model_outputs, target);
    } catch (const c10::Error& error) {
      // LibTorch's message alone ("The size of tensor a (4) must match ...") does not say it came from the loss.
      std::string outputs;
      for (const auto& output : produced.model_outputs) {
        outputs += (outputs.empty() ? "" : ", ") + (output.defined() ? c10::str(output.sizes()) : std::string("None"));
      }
      throw ModelError("the loss function failed on microbatch " + std::to_string(microbatch) + " (outputs " + outputs +
                       ", target " + (target.defined() ? c10::str(target.sizes()) : std::string("None")) +
                       "): " + error.what_without_backtrace());
    }
    // A loss of several values would go into backward as their sum (its root gradient is ones_like) and fail only
    // when the step's loss is read.
    if (!loss.defined() || loss.numel() != 1) {
      throw ModelError("the loss function returned " +
                       (loss.defined() ? "a tensor of shape " + c10::str(loss.sizes()) : std::string("no tensor")) +
                       " for microbatch " + std::to_string(microbatch) +
                       ": it must reduce the microbatch to one value (as .mean() or .sum() do)");
    }
    const double weight = data_.loss_weights.empty() ? 1.0 / static_cast<double>(schedule_.num_microbatches)
                                                     : data_.loss_weights.at(microbatch);
    entry.loss = loss * (data_.loss_scale * weight);
  }

  // The roots of this stage's backward and the gradients flowing into them.
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> backward_roots(int stage, int microbatch, Stash& entry) {
    if (!entry.outputs_ready) {  // checkpointed: rebuild the graph first
      const RecomputeScope same_as_first_run(entry.before_forward,
                                             stages_.buffers ? stages_.buffers(stage) : std::vector<at::Tensor>{},
                                             executor_.pipeline_.device());
      c10::AutoGradMode enable_grad(true);
      run_forward(stage, microbatch, entry, /*recompute=*/true);
    }
    std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> roots;
    if (entry.loss.defined()) {
      if (!entry.loss.requires_grad()) {
        throw ModelError("the loss of microbatch " + std::to_string(microbatch) + " does not require gradients: the "
                         "loss function detached it from the model's output (.detach(), .item(), torch.no_grad), or "
                         "no parameter of the model trains");
      }
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
  }

  void finish_backward(const sched::Action& action, Stash& entry) {
    entry.backward_done = true;
    entry.outputs.clear();
    entry.outputs_ready = false;
    entry.output_grads.clear();
    entry.loss = at::Tensor();
    --stashed_;
    if (entry.gradient_sends_left == 0) drop(action);
  }

  // --- Transfers ---

  int tag_of(const sched::Action& action) const {
    const int stages = schedule_.num_stages, microbatches = schedule_.num_microbatches;
    switch (action.kind) {
      case ActionKind::SendForward: return transfer_tag(Direction::Activation, action.stage, action.peer_stage, action.microbatch, stages, microbatches);
      case ActionKind::RecvForward: return transfer_tag(Direction::Activation, action.peer_stage, action.stage, action.microbatch, stages, microbatches);
      case ActionKind::SendBackward: return transfer_tag(Direction::Gradient, action.stage, action.peer_stage, action.microbatch, stages, microbatches);
      default: return transfer_tag(Direction::Gradient, action.peer_stage, action.stage, action.microbatch, stages, microbatches);
    }
  }

  std::string where(const sched::Action& action) const {
    return sched::describe(action) + " on rank " + std::to_string(executor_.pipeline_.global_rank(me_));
  }

  int peer_of(const sched::Action& action) const { return schedule_.stage_to_rank[action.peer_stage]; }

  // Every receive's header is posted before the first compute, so a message is taken in as soon as its sender
  // posts it and the wait at the receive action covers only what compute could not hide. The payload receives of
  // the next kPayloadsAhead receives from each peer are posted too (in the layout remembered from the last step),
  // so that their payloads travel at once; each completed receive posts the next one's.
  static constexpr std::size_t kPayloadsAhead = 2;
  void post_receives() {
    for (std::size_t i = 0; i < actions_.size(); ++i) {
      const auto& action = actions_[i];
      if (action.kind != ActionKind::RecvForward && action.kind != ActionKind::RecvBackward) continue;
      const int peer = peer_of(action);
      if (peer == me_) continue;
      posted_[i] = std::make_unique<comm::IncomingTensors>(executor_.pipeline_, peer, tag_of(action), where(action),
                                                           &executor_.layouts_, data_.stamp);
      receives_from_[peer].push_back(i);
    }
    for (const auto& [peer, receives] : receives_from_) {
      for (std::size_t k = 0; k < receives.size(); ++k) {
        place_among_receives_[receives[k]] = k;
        if (k < kPayloadsAhead) posted_[receives[k]]->post_expected();
      }
    }
  }

  void post_next_payloads(std::size_t received) {
    const auto& receives = receives_from_.at(peer_of(actions_[received]));
    const std::size_t next = place_among_receives_.at(received) + kPayloadsAhead;
    if (next < receives.size()) posted_[receives[next]]->post_expected();
  }

  // An in-order transport (NCCL) must take a peer's messages in the peer's send order: a message this rank needs
  // later is taken in early and kept. That never waits for more than the wanted message does: its sender sent
  // everything before it first.
  std::vector<at::Tensor> receive_posted(std::size_t index) {
    try {
      return receive_posted_of_this_call(index);
    } catch (const comm::TransferOutOfStep& error) {
      const ProgramCall theirs = ProgramCall::from_id(error.sent.call), ours = ProgramCall::from_id(error.expected.call);
      const bool calls_differ = error.sent.call != error.expected.call && error.sent.call != comm::kUnchecked &&
                                error.expected.call != comm::kUnchecked;
      // Which of the two was given the odd batch, neither end can tell: this rank's shapes say which it was given.
      const std::string why = calls_differ
                                  ? "it is in its " + theirs.describe() + ", this rank in its " + ours.describe()
                                  : "in " + ours.describe() + " the two were given batches of other shapes; this " +
                                        "rank's first microbatch: " + microbatch_shapes();
      throw comm::CommError(std::string(error.what()) + " (" + why + "): " + kSameCallsEverywhere);
    }
  }

  std::string microbatch_shapes() const {
    const auto shape_of = [](const at::Tensor& tensor) {
      if (!tensor.defined()) return std::string("none");
      std::string text = "[";
      for (std::int64_t i = 0; i < tensor.dim(); ++i) text += (i ? ", " : "") + std::to_string(tensor.size(i));
      return text + "]";
    };
    std::string text = "inputs";
    if (!data_.inputs.empty()) {
      for (const auto& input : data_.inputs.front()) text += " " + shape_of(input);
    }
    if (!data_.targets.empty()) text += ", targets " + shape_of(data_.targets.front());
    return text;
  }

  std::vector<at::Tensor> receive_posted_of_this_call(std::size_t index) {
    if (taken_early_[index]) return std::move(early_[index]);
    if (!executor_.receive_order_.empty()) {
      const int peer = peer_of(actions_[index]);
      const auto& order = executor_.receive_order_.at(peer);
      auto& next = next_in_order_[peer];
      for (; next < order.size() && order[next] != index; ++next) {
        early_[order[next]] = posted_[order[next]]->wait();
        taken_early_[order[next]] = true;
      }
      if (next == order.size()) throw sched::ScheduleError(where(actions_[index]) + ": not in its sender's order");
      ++next;
    }
    return posted_[index]->wait();
  }

  // A send's tensors go as soon as a receive proves it delivered (the peer took it before sending what arrived);
  // the transports cannot be asked without waiting (Gloo), or a send's header travels over Gloo (NCCL). Otherwise
  // they would live until the step's end, one sent output and one input gradient per microbatch beyond the
  // schedule's bound on the stash.
  void release_delivered(std::size_t receive_index) {
    const auto proven = executor_.delivered_by_receive_.find(receive_index);
    if (proven == executor_.delivered_by_receive_.end()) return;
    for (std::size_t send_index : proven->second) {
      const auto found = sends_.find(send_index);
      if (found == sends_.end()) continue;
      found->second->wait();  // returns at once: the peer has the message
      sends_.erase(found);
      ++stats_.sends_released_early;
    }
  }

  std::vector<at::Tensor> receive(std::size_t index) {
    if (posted_[index]) {
      auto tensors = receive_posted(index);
      post_next_payloads(index);
      release_delivered(index);
      return tensors;
    }
    auto mail = local_mail_.find(tag_of(actions_[index]));
    if (mail == local_mail_.end()) throw sched::ScheduleError(where(actions_[index]) + ": local message missing");
    auto tensors = std::move(mail->second);
    local_mail_.erase(mail);
    return tensors;
  }

  void send(std::size_t index, std::vector<at::Tensor> tensors) {
    const sched::Action& action = actions_[index];
    const int peer = peer_of(action);
    if (peer == me_) {
      local_mail_[tag_of(action)] = std::move(tensors);
      return;
    }
    // Evaluation: one send in flight while the next output is computed, the older ones waited for.
    constexpr std::size_t kEvaluationSendsHeld = 2;
    bool released = false;
    while (executor_.wait_for_oldest_send_ && sends_.size() >= kEvaluationSendsHeld) {
      sends_.begin()->second->wait();
      sends_.erase(sends_.begin());
      ++stats_.sends_released_early;
      released = true;
    }
    // On a GPU a wait only orders the compute stream after the send, and the dropped tensor stays reserved until the
    // send is done: without waiting here, the host would run ahead and hold one output per microbatch after all.
    if (released) executor_.pipeline_.synchronize();
    sends_[index] = comm::send_tensors(executor_.pipeline_, tensors, peer, tag_of(action), where(action),
                                       &executor_.layouts_, data_.stamp);
    ++stats_.sends_posted;
    stats_.peak_sends_held = std::max(stats_.peak_sends_held, static_cast<int>(sends_.size()));
  }

  PipelineExecutor& executor_;
  const sched::Schedule& schedule_;
  const StageCallbacks& stages_;
  const MicrobatchData& data_;
  const int me_;
  const std::vector<sched::Action>& actions_;
  const bool evaluating_;     // no graphs, nothing kept for a backward
  const bool keep_outputs_;   // this rank runs the last stage and the caller keeps its outputs
  ExecutorStats stats_;
  std::map<std::pair<int, int>, Stash> stash_;  // (stage, microbatch)
  int stashed_ = 0;
  at::Tensor loss_sum_;  // on the losses' device, so that summing them does not wait for the GPU
  std::vector<std::vector<at::Tensor>> uneven_outputs_;  // per output, per microbatch (MicrobatchData::uneven)
  std::map<int, std::vector<at::Tensor>> local_mail_;  // tag -> tensors between two stages of this rank
  std::vector<std::unique_ptr<comm::IncomingTensors>> posted_;  // by action index: receives from other ranks
  std::map<int, std::vector<std::size_t>> receives_from_;       // peer -> its receives, in this rank's order
  std::map<std::size_t, std::size_t> place_among_receives_;     // receive -> its place in receives_from_
  std::vector<std::vector<at::Tensor>> early_;                  // in-order transports: taken ahead of need
  std::vector<bool> taken_early_;
  std::map<int, std::size_t> next_in_order_;                    // peer -> position in receive_order_
  std::map<std::size_t, std::unique_ptr<comm::Pending>> sends_;  // by action index, until proven delivered
};

static_assert(static_cast<int>(ActionKind::Forward) == 0 && static_cast<int>(ActionKind::Backward) == 1 &&
                  static_cast<int>(ActionKind::BackwardInput) == 2 && static_cast<int>(ActionKind::BackwardWeight) == 3 &&
                  static_cast<int>(ActionKind::SendForward) == 4 && static_cast<int>(ActionKind::RecvForward) == 5 &&
                  static_cast<int>(ActionKind::SendBackward) == 6 && static_cast<int>(ActionKind::RecvBackward) == 7,
              "the handler table follows ActionKind's order");
const std::array<PipelineExecutor::Step::Handler, 8> PipelineExecutor::Step::kHandlers = {
    &Step::forward,      &Step::backward,        &Step::backward_input, &Step::backward_weight,
    &Step::send_forward, &Step::receive_forward, &Step::send_backward,  &Step::receive_backward};

ExecutorStats PipelineExecutor::run(const StageCallbacks& stages, const MicrobatchData& data) {
  return Step(*this, stages, data).run();
}

}  // namespace smp
