#pragma once
// A pipeline schedule is data: for each pipeline rank, the ordered list of actions it performs in one
// training step. Generators write compute-only lists; lower_communication() adds the transfers so that both
// ends of every transfer come from the same pass; validate() rejects anything the engine could not run.
// Plain C++: no LibTorch here, so these tests run in milliseconds.

#include <cstdint>
#include <iosfwd>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace smp::sched {

enum class ActionKind : std::uint8_t {
  Forward,         // F: run the stage forward for one microbatch
  Backward,        // B: full backward (input and weight gradients)
  BackwardInput,   // I: input-gradient part of backward only
  BackwardWeight,  // W: weight-gradient part, after the matching I
  SendForward,     // SEND_F: ship this stage's outputs for a microbatch to peer_stage
  RecvForward,     // RECV_F: wait for the inputs of a microbatch from peer_stage
  SendBackward,    // SEND_B: ship input gradients of a microbatch back to peer_stage
  RecvBackward,    // RECV_B: wait for output gradients of a microbatch from peer_stage
};

struct Action {
  ActionKind kind;
  int stage;       // the stage this rank executes the action for
  int microbatch;
  int peer_stage = -1;  // transfers only: the stage at the other end

  bool operator==(const Action& other) const {
    return kind == other.kind && stage == other.stage && microbatch == other.microbatch &&
           peer_stage == other.peer_stage;
  }
  bool operator!=(const Action& other) const { return !(*this == other); }
};

// "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B" (as torch.distributed.pipelining spells them).
const char* to_string(ActionKind kind);
ActionKind action_kind_from_string(const std::string& text);  // throws ScheduleError on unknown text
bool is_compute(ActionKind kind);
bool is_send(ActionKind kind);  // SEND_F or SEND_B
// e.g. "F(stage 2, mb 3)" or "SEND_F(stage 1 -> 2, mb 0)"
std::string describe(const Action& action);

class ScheduleError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Which stages feed which: consumers[s] lists the stages that take an output of stage s (always later
// stages). A chain is consumers[s] = {s + 1}. Stage 0 takes the batch, the last stage produces the loss.
struct StageGraph {
  std::vector<std::vector<int>> consumers;

  static StageGraph chain(int num_stages);
  int num_stages() const { return static_cast<int>(consumers.size()); }
  std::vector<int> producers_of(int stage) const;
};

struct Schedule {
  std::string name;      // generator name, e.g. "gpipe", "1f1b"
  int num_ranks = 0;     // pipeline ranks
  int num_stages = 0;    // stages (num_ranks * virtual stages per rank)
  int num_microbatches = 0;
  bool split_backward = false;    // true when the schedule uses I + W instead of B
  bool forward_only = false;      // an evaluation step: F and its transfers, no backward (see forward_only())
  std::vector<int> stage_to_rank; // stage -> pipeline rank that owns it
  std::vector<std::vector<Action>> ranks;  // per pipeline rank, in execution order

  std::vector<int> stages_of_rank(int rank) const;
};

// Fill-drain: every forward of every microbatch, then every backward (in reverse microbatch order).
Schedule make_gpipe(int num_ranks, int num_microbatches);
// One forward, one backward in steady state. max_active caps the microbatches in flight per rank
// (SMP's active_microbatches); 0 means the natural 1F1B bound of num_ranks - rank.
Schedule make_1f1b(int num_ranks, int num_microbatches, int max_active = 0);
// Megatron-LM's interleaved 1F1B: rank r owns stages r, r + num_ranks, ... (virtual_stages of them), which run as
// the chain StageGraph::chain(num_ranks * virtual_stages), wrapping from the last rank back to rank 0. Smaller
// stages shrink the bubble to (p - 1) / (v * m + p - 1) of the step when m is a multiple of p; any m >= 1 works.
// max_active caps the (stage, microbatch) pairs in flight per rank: 0 (Megatron-LM's bound) or at least
// virtual_stages. virtual_stages = 1 gives make_1f1b's order.
Schedule make_interleaved_1f1b(int num_ranks, int num_microbatches, int virtual_stages, int max_active = 0);
// Breadth-first looped ("Breadth-First Pipeline Parallelism", Lamy-Poirier, MLSys 2023; torch.distributed.pipelining's
// ScheduleLoopedBFS): the looped layout of interleaved 1F1B (rank r owns stages r, r + num_ranks, ...), but each
// rank runs every microbatch's forward through one of its stages before the next, then the backwards stage by stage
// in reverse (microbatches in reverse, as GPipe). Holds every (stage, microbatch) until the backwards start, as
// GPipe does; in exchange a stage's weight gradients are final early (for data-parallel overlap). virtual_stages = 1
// gives make_gpipe's order.
Schedule make_looped_bfs(int num_ranks, int num_microbatches, int virtual_stages);
// ZB-H1 and ZB-H2 from "Zero Bubble Pipeline Parallelism" (Qi et al., ICLR 2024): backward split into I and W
// (split_backward), W deferred to fill the bubble. ZB-H1 holds at most num_ranks microbatches on any rank, as 1F1B
// does on rank 0; ZB-H2 runs more forwards ahead and holds up to 2 * num_ranks - 1. max_active caps what a rank
// holds (from F to W); 0 means the schedule's own bound.
Schedule make_zero_bubble_h1(int num_ranks, int num_microbatches, int max_active = 0);
Schedule make_zero_bubble_h2(int num_ranks, int num_microbatches, int max_active = 0);

// ZB-V from "Zero Bubble Pipeline Parallelism" (Qi et al., ICLR 2024): two stages per rank in a V (rank r runs
// stages r and 2 * num_ranks - 1 - r, so the first and the last stage, where the loss is, share rank 0), backward
// split into I and W with the Ws filling the bubbles; each rank holds at most 2 * num_ranks stage-microbatches, the
// activations of num_ranks whole microbatches as under 1F1B. Any num_microbatches >= 1 (built for at least
// 2 * num_ranks - 1 and the rest left out).
Schedule make_zero_bubble_v(int num_ranks, int num_microbatches);
// DualPipeV (DeepSeek's DualPipe, folded into a V as above): after its warm-up each rank pairs a forward of one of
// its stages with a full backward of the other, which DualPipe overlaps on GPUs; here they run one after the other
// (a full backward is I then W). Holds at most 2 * num_ranks + 1 stage-microbatches. Built for at least
// 2 * num_ranks microbatches, the rest left out.
Schedule make_dualpipe_v(int num_ranks, int num_microbatches);

// What the engine knows of a schedule besides its generator. Adding a schedule is one generator and one entry of
// schedule_kinds() (generators.cpp).
struct ScheduleKind {
  const char* name;          // the generator's: smp_schedule --schedule, schedule files, the config's "pipeline"
  const char* config_alias;  // SMP's name for it in the config's "pipeline" ("simple", ...), or ""
  int stages_per_rank;       // 1; 0: any number (virtual_stages); 2: a V
  bool split_backward;       // I and W instead of B
  bool takes_cap;            // max_active (SMP's active_microbatches) applies; make_schedule refuses it otherwise
  bool planned;              // among the layouts the planner ("auto", smp.plan, smp_plan) weighs
  Schedule (*make)(int num_ranks, int num_microbatches, int virtual_stages, int max_active);
};
const std::vector<ScheduleKind>& schedule_kinds();
// The kind called `name`, or called `name` in the config ("interleaved" is 1F1B with one stage per rank and
// interleaved 1F1B with several, as SMP has it). Throws ScheduleError listing the names for any other.
const ScheduleKind& find_schedule_kind(const std::string& name, int virtual_stages = 1);

// The generator called `name`, one of schedule_names(); throws ScheduleError for any other name, for a
// virtual_stages its layout does not have (1 for one stage per rank, 2 for a V), and for max_active != 0 with a
// schedule that takes no cap.
Schedule make_schedule(const std::string& name, int num_ranks, int num_microbatches, int virtual_stages,
                       int max_active);
// "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zb_v", "dualpipe_v"
std::vector<std::string> schedule_names();

// The forward actions of `schedule` and their transfers, in the same order on every rank, with forward_only set:
// an evaluation step. Deadlock-free whenever `schedule` is: each forward waits for the same receives it waited
// for there, behind fewer actions.
Schedule forward_only(const Schedule& schedule);

// Adds SEND_F/RECV_F/SEND_B/RECV_B around the compute actions of a compute-only schedule. Sends are posted
// right after the compute that produces them and receives right before the compute that needs them; the
// engine posts sends asynchronously and never waits on a send before its program ends, so the only blocking
// actions are receives, and the schedule is deadlock-free iff the simulator finds no cycle.
Schedule lower_communication(const Schedule& compute_only, const StageGraph& graph);

// Throws ScheduleError naming the rank, the position and the offending action when the schedule is malformed:
// unknown stage or rank, an action on a stage the rank does not own, a microbatch out of range, duplicates,
// missing actions (each stage must F, and B or I+W, each microbatch exactly once; F alone when forward_only, which
// admits no backward action or gradient transfer), B/I before its F, W before
// its I, a receive without the matching send on the peer (or the reverse), or an order that deadlocks.
void validate(const Schedule& schedule, const StageGraph& graph);

// Transports that match the messages between two ranks by their order instead of by tag (NCCL) must take a
// peer's messages in the order the peer sends them. For each peer of `rank`, the indices into schedule.ranks[rank]
// of the receives from that peer, in the peer's send order. Most lowered schedules receive in exactly this order;
// some (interleaved 1F1B with skip connections on 3 ranks) do not, and the executor then receives ahead.
std::map<int, std::vector<std::size_t>> receives_in_send_order(const Schedule& schedule, int rank);

// For each receive of `rank` from another rank (its index in schedule.ranks[rank]), the indices of earlier sends
// of `rank` (to any rank) whose receiver took them before this message was sent, directly or through other ranks'
// messages: once the receive completes, those sends have certainly been delivered, whatever the transport says
// (Gloo cannot be asked without waiting), and their tensors can go. Each send is listed under the first receive
// that certifies it; receives that certify nothing new are absent.
std::map<std::size_t, std::vector<std::size_t>> sends_delivered_by_receive(const Schedule& schedule, int rank);

// A forward of `rank` run at once with the backward the schedule puts after it (config
// "overlap_forward_backward"; DualPipe's pairs): the forward on a second thread, from its index up to `last`, the
// backward's last compute action, while the rank goes on through the actions in between. Those are transfers and
// the compute of one other (stage, microbatch)'s backward only. The forward's sends, and every send after one, are
// `held` (indices, in order) until the forward is done. A receive after a held send to another rank ends the
// window, since the receive's sender may wait for the held send first; so does a receive from this rank's other
// stage after any held send. Keyed by the forward's index; forwards without a backward in their window are absent.
struct OverlapWindow {
  std::size_t last = 0;
  std::vector<std::size_t> held;
};
std::map<std::size_t, OverlapWindow> overlapped_pairs(const Schedule& schedule, int rank);

// One action per line: "rank,kind,stage,microbatch,peer_stage" after a header line; see schedule.cpp.
void write_csv(const Schedule& schedule, std::ostream& out);
Schedule read_csv(std::istream& in);  // throws ScheduleError naming the line

}  // namespace smp::sched
