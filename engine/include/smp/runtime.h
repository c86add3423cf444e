#pragma once
// The process's place in the job: config, topology, and the communicators built on them.
// smp::Runtime::init() is the first call of every smp program (SMP's smp.init()).

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "smp/comm/communicator.h"
#include "smp/comm/launch_info.h"
#include "smp/config.h"
#include "smp/topology.h"

namespace c10d {
class Store;
}

namespace smp {

// Whether the processes of one host each see a GPU of their own, as a launcher that binds GPUs through
// CUDA_VISIBLE_DEVICES arranges (Slurm's --gpus-per-task=1): `visible_devices` holds the variable of each of the
// host's processes ("" when unset), and this is true when every one names a single device and no two the same.
// Processes that all see the same single GPU share it instead.
bool gpus_assigned_per_process(const std::vector<std::string>& visible_devices);

class Runtime {
 public:
  // Validates the config against the launch (world size, replicas, batch) before any communication, then
  // rendezvouses on the TCPStore at MASTER_ADDR:MASTER_PORT (SMP_MASTER_PORT under smprun) and creates the world, pipeline and
  // data-parallel groups. Throws ConfigError or comm::CommError with a one-line reason.
  static std::shared_ptr<Runtime> init(const Config& config);
  static std::shared_ptr<Runtime> init(const Config& config, const comm::LaunchInfo& launch);

  const Config& config() const { return config_; }
  // A config given "auto" layout keys starts under its provisional layout (Config::provisional_layout); once the
  // planner has chosen, every rank calls this with the same chosen config (those keys filled in) at the same point:
  // the topology and the pipeline, replica, tensor- and expert-parallel groups are made anew for it. ConfigError
  // when nothing was left to choose or the choice does not fit the world.
  void adopt_layout(const Config& chosen);
  // The layout was adopted (planned, or a resume's): its partition_overrides pin the modules of the model it was
  // made for, a config with "auto" keys giving none of its own.
  bool layout_adopted() const { return layout_generation_ > 0; }
  // The next model built is the one a plan was made for (its memory judged by the planner's predicted peak): said
  // by whoever adopted the plan, taken by that model's constructor on every rank; false for any other (a teacher
  // built after, a layout a resume adopted).
  void expect_planned_model() { planned_model_pending_ = true; }
  bool take_planned_model() { return std::exchange(planned_model_pending_, false); }
  // On rank 0 of a C++ job whose layout was planned (with_planned_layout): the layout and its predicted train_step
  // (the optimizer's step apart), which DistributedModel logs beside the measured one after five steps.
  struct PlannedStep {
    std::string layout;
    double predicted_s = 0.0;
    double optimizer_s = 0.0;
    std::vector<double> measured_s;  // steps 2 to 5 (log_step_against_plan)
  };
  void note_planned_step(PlannedStep planned) { planned_step_ = std::move(planned); }
  // Speeds measured for "device_speeds": "measure" (device_speeds in training/device_speeds.h), once per job: the
  // planner of "auto" keys and the partition of the model use the same.
  void remember_device_speeds(std::vector<double> speeds) { measured_device_speeds_ = std::move(speeds); }
  const std::optional<std::vector<double>>& measured_device_speeds() const { return measured_device_speeds_; }
  const std::optional<PlannedStep>& planned_step() const { return planned_step_; }
  std::optional<PlannedStep>& planned_step() { return planned_step_; }
  const Topology& topology() const { return topology_; }
  const comm::LaunchInfo& launch() const { return launch_; }
  int rank() const { return launch_.rank; }
  int world_size() const { return launch_.world_size; }
  int pp_rank() const { return coordinates_.pp_rank; }
  int dp_rank() const { return coordinates_.dp_rank; }
  int tp_rank() const { return coordinates_.tp_rank; }
  const Coordinates& coordinates() const { return coordinates_; }
  // Where this rank's stages run: the CPU, or its GPU (config "device"; LOCAL_RANK picks the GPU).
  c10::Device device() const { return device_; }

  comm::Communicator& world() { return *world_; }
  comm::Communicator& pipeline() { return *pipeline_; }  // group rank == pp_rank
  comm::Communicator& data_parallel() { return *data_parallel_; }  // group rank == dp_rank
  // The ranks holding the other shards of this rank's stages (group rank == tp_rank); this rank alone when
  // tensor_parallel_degree is 1.
  comm::Communicator& tensor_parallel() { return *tensor_parallel_; }
  std::shared_ptr<comm::Communicator> tensor_parallel_group() const { return tensor_parallel_; }
  // The replicas that divide the experts among them (group rank == ep_rank; this rank alone when
  // expert_parallel_degree is 1), and those holding the same experts as this one (the data-parallel group when
  // expert_parallel_degree is 1).
  comm::Communicator& expert_parallel() { return *expert_parallel_; }
  comm::Communicator& expert_data_parallel() { return *expert_data_parallel_; }
  int ep_rank() const { return topology_.ep_rank(coordinates_); }
  // Makes the group that smp::replica_sum pools statistics over (a synchronized batch norm's): this rank's stage's
  // replicas. Every rank calls it, once a model needs it; later calls do nothing.
  void use_replica_statistics();

  // A group of `members` (global ranks) for tensors on device(): NCCL for a GPU unless "backend" is "gloo".
  // Only the members call it, with the same arguments.
  std::shared_ptr<comm::Communicator> make_group(const std::vector<int>& members, const std::string& name);

  // After a failure midway through work shared with its peers (a step that threw on this rank alone, while its
  // peers wait for its transfers or collectives), this rank is out of step with them for good: it leaves every
  // group it is in (Communicator::leave: peers waiting on it fail now, naming `reason`), and left_job() holds the
  // reason from then on, for whoever would start more shared work. A job of one process has no peers: nothing to
  // leave, and it stays in step.
  void leave_job(const std::string& reason);
  const std::optional<std::string>& left_job() const { return left_job_; }
  // Runs `work`, which the peers run alongside (a schedule's transfers, a step's collectives); when it throws, this
  // rank leaves the job naming `what` and the error, and the error goes on. Errors before such work leave the job
  // in step.
  void with_peers(const std::string& what, const std::function<void()>& work);
  // CommError naming `caller` once this rank has left the job: its peers are out of step with it.
  void refuse_after_leaving(const std::string& caller) const;

  // A number that every rank draws in the same order, to keep the keys of repeated exchanges apart (e.g. two
  // models built by one job).
  int next_exchange() { return exchanges_++; }

  // Small control messages (the partition plan): rank `from` publishes, the others wait up to the timeout.
  void publish(const std::string& key, const std::string& value);
  std::string fetch(const std::string& key);
  // Whether `key` is published now (no waiting).
  bool published(const std::string& key);
  // Adds `by` to the counter under `key` (0 when new) and returns its value: ranks say they are done, one each.
  std::int64_t count(const std::string& key, std::int64_t by);
  // Drops a published key once every reader has it (what a job publishes per step would otherwise pile up).
  void forget(const std::string& key);
  // What `make` returns on rank 0, on every rank (the others wait up to the timeout). When it throws there, the
  // others throw ConfigError naming rank 0's reason, and rank 0 rethrows its own.
  std::string from_rank0(const std::string& key, const std::function<std::string()>& make);

  // This replica's contiguous share of a global batch (dimension 0), as at::tensor_split gives it (the first
  // replicas a sample more where it does not split evenly: tell the step, DistributedModel::next_call_takes_share_of).
  // ConfigError, on every rank alike, when the batch does not fill every replica's microbatches; with
  // fill_microbatches false (an evaluation's short last batch, which evaluate takes) any batch of a sample or more,
  // a replica's share then possibly empty.
  at::Tensor replica_slice(const at::Tensor& global_batch, bool fill_microbatches = true) const;

 private:
  Runtime(const Config& config, const comm::LaunchInfo& launch);
  // The groups of the current topology; `prefix` keeps a later layout's apart from earlier ones in the store.
  void make_layout_groups(const std::string& prefix);
  // A group whose collectives run inside a stage's compute: two lanes when forwards and backwards overlap.
  std::shared_ptr<comm::Communicator> in_compute_group(const std::vector<int>& members, const std::string& name);
  // Refuses to go on with a store that another job (another SMP_JOB_ID or TORCHELASTIC_RUN_ID) hosts.
  void check_job_identity(const std::string& where);
  // ConfigError on a rank whose smp keys differ from rank 0's (ranks reading different files or per-rank values):
  // they would each plan another schedule or precision and meet only at a timeout, or train apart silently.
  void check_same_config();

  Config config_;
  comm::LaunchInfo launch_;
  Topology topology_;
  Coordinates coordinates_;
  c10::Device device_;
  bool nccl_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<comm::Communicator> world_;
  std::shared_ptr<comm::Communicator> pipeline_;
  std::shared_ptr<comm::Communicator> data_parallel_;
  std::shared_ptr<comm::Communicator> tensor_parallel_;
  std::shared_ptr<comm::Communicator> expert_parallel_;
  std::shared_ptr<comm::Communicator> expert_data_parallel_;
  std::shared_ptr<comm::Communicator> replica_statistics_;  // made by use_replica_statistics
  std::vector<std::weak_ptr<comm::Communicator>> groups_;  // every group made, for leave_job
  std::optional<std::string> left_job_;
  mutable bool said_batch_differs_ = false;  // replica_slice's note, once
  int exchanges_ = 0;
  std::string bind_host_;
  int layout_generation_ = 0;  // layouts adopted after the first (adopt_layout)
  bool planned_model_pending_ = false;
  std::optional<PlannedStep> planned_step_;
  std::optional<std::vector<double>> measured_device_speeds_;
};

}  // namespace smp
