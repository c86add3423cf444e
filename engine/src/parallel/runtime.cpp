#include "smp/runtime.h"

#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Logging.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <nlohmann/json.hpp>

#include "smp/checkpoint_manifest.h"
#include "smp/comm/laned_communicator.h"
#include "smp/errors.h"
#include "smp/comm/sockets.h"
#include "smp/log.h"
#include "smp/replica_statistics.h"
#include "smp/tp.h"

namespace smp {
namespace {

// LibTorch's own error log off while it lives (c10::MessageLogger drops what is below FLAGS_caffe2_log_level).
class QuietLibTorchLog {
 public:
  QuietLibTorchLog() : before_(FLAGS_caffe2_log_level) { FLAGS_caffe2_log_level = 3; }  // fatal alone
  ~QuietLibTorchLog() { FLAGS_caffe2_log_level = before_; }
  QuietLibTorchLog(const QuietLibTorchLog&) = delete;
  QuietLibTorchLog& operator=(const QuietLibTorchLog&) = delete;

 private:
  int before_;
};

std::chrono::milliseconds timeout_of(const Config& config) {
  return std::chrono::milliseconds(static_cast<long long>(config.comm_timeout_s * 1000.0));
}

// Whether GPU tensors would move over NCCL: "auto" falls back to Gloo in a build without NCCL; "nccl" there fails
// in make_nccl_group, saying why.
bool nccl_for_gpus(const Config& config) {
  return config.backend == "nccl" || (config.backend == "auto" && comm::nccl_available());
}

std::string visible_devices() {
  const char* value = std::getenv("CUDA_VISIBLE_DEVICES");
  return value == nullptr ? "" : value;
}

// Whether this process sees one GPU that may be its own, though its host runs several processes: only the other
// processes' CUDA_VISIBLE_DEVICES can tell (gpus_assigned_per_process), after the rendezvous.
bool may_have_own_gpu(const Config& config, const comm::LaunchInfo& launch) {
  const std::string visible = visible_devices();
  return config.device != "cpu" && launch.world_size > 1 && launch.local_world_size > 1 && !visible.empty() &&
         visible.find(',') == std::string::npos && torch::cuda::device_count() == 1;
}

std::string nccl_version_text(int version) {
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." + std::to_string(version % 100);
}

// More processes than GPUs on a host with "device": "cuda": NCCL before 2.30 refuses two ranks on one GPU (and
// would say so only inside communicator creation); 2.30 and later share one when NCCL_MULTI_RANK_GPU_ENABLE is 1
// in every process of the host (each checks all its peers), which the user asked for by starting more processes
// than GPUs, so it is set here unless they set it otherwise. NCCL reads it at its first communicator, after this.
void allow_nccl_to_share_gpus(const Config& config, const comm::LaunchInfo& launch, int gpus) {
  const std::string where = config.source + ": rank " + std::to_string(launch.rank) + "'s host runs " +
                            std::to_string(launch.local_world_size) + " processes but has " + std::to_string(gpus) +
                            " CUDA device(s)";
  const int version = comm::nccl_version();
  if (version < comm::kNcclSharesGpusFrom) {
    throw ConfigError(where + ": NCCL " + nccl_version_text(version) +
                      " needs one GPU per process (2.30 and later can share one). Start at most " +
                      std::to_string(gpus) + " processes per host, load NCCL 2.30 or later, or set "
                      "\"backend\": \"gloo\" to share GPUs");
  }
  const char* setting = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  if (setting == nullptr) {
    ::setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
  } else if (std::string(setting) != "1") {
    throw ConfigError(where + " and NCCL_MULTI_RANK_GPU_ENABLE=" + setting +
                      " forbids NCCL to share one: unset it, start at most " + std::to_string(gpus) +
                      " processes per host, or set \"backend\": \"gloo\"");
  }
}

// "auto" takes a GPU when every process of this host can have its own (hosts are assumed alike), else the CPU.
// NCCL needs one GPU per process; Gloo can share one among the processes of a host (tests on a one-GPU machine).
// `own_gpu`: the launcher gave each process of this host a GPU of its own, the only one it sees.
c10::Device choose_device(const Config& config, const comm::LaunchInfo& launch, bool own_gpu) {
  if (config.device == "cpu") return c10::Device(c10::kCPU);
  if (own_gpu) return c10::Device(c10::kCUDA, 0);
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (config.device == "auto") {
    if (gpus == 0 || gpus < launch.local_world_size) return c10::Device(c10::kCPU);
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(launch.local_rank));
  }
  if (gpus == 0) {
    throw ConfigError(config.source + ": key \"device\" is \"cuda\", but rank " + std::to_string(launch.rank) +
                      " sees no CUDA device (check CUDA_VISIBLE_DEVICES and the driver), or set \"device\": \"auto\"");
  }
  if (launch.local_world_size > gpus && nccl_for_gpus(config)) allow_nccl_to_share_gpus(config, launch, gpus);
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(launch.local_rank % gpus));
}

std::string join(const std::vector<int>& ranks) {
  std::string text;
  for (int rank : ranks) text += (text.empty() ? "" : ",") + std::to_string(rank);
  return text;
}

}  // namespace

bool gpus_assigned_per_process(const std::vector<std::string>& visible_devices) {
  if (visible_devices.size() < 2) return false;
  std::set<std::string> seen;
  for (const auto& value : visible_devices) {
    if (value.empty() || value.find(',') != std::string::npos || !seen.insert(value).second) return false;
  }
  return true;
}

std::shared_ptr<Runtime> Runtime::init(const Config& config) {
  return init(config, comm::LaunchInfo::from_environment());
}

std::shared_ptr<Runtime> Runtime::init(const Config& config, const comm::LaunchInfo& launch) {
  return std::shared_ptr<Runtime>(new Runtime(config, launch));
}

Runtime::Runtime(const Config& given, const comm::LaunchInfo& launch)
    : config_(given.auto_keys.empty() ? given : given.provisional_layout(launch.world_size)),
      launch_(launch),
      topology_(config_, launch.world_size),
      coordinates_(topology_.coordinates_of(launch.rank)),
      // Decided after the rendezvous when only the other processes can tell (may_have_own_gpu); every other
      // device error comes before any communication.
      device_(may_have_own_gpu(config_, launch) ? c10::Device(c10::kCPU) : choose_device(config_, launch, false)),
      nccl_(device_.is_cuda() && nccl_for_gpus(config_)) {
  log::configure(launch_.rank, config_.log_level);
#ifdef __GLIBC__
  // Overlapped pairs allocate a forward's activations on a second thread and free them on this one. glibc gives
  // each thread an arena of its own, and the two pools each grew to their own peak, faulting in fresh pages every
  // step: measured on the Mixtral bench (DualPipeV, ep 2), 14% slower and a third more resident memory than one
  // shared arena, which matched the sequential order. CPU tensors only: GPU memory is the caching allocator's.
  if (config_.overlap_forward_backward) mallopt(M_ARENA_MAX, 1);
#endif
  // c10d logs a C++ backtrace with every warning (e.g. a store connection closed by a peer that failed); our
  // errors already name the peer, so LibTorch's own warnings show only when debugging.
  if (!log::enabled("debug")) FLAGS_caffe2_log_level = 2;
  // Processes that share a host must not each start one thread per core: on a small machine the oversubscribed
  // intra-op pools make a pipeline many times slower. OMP_NUM_THREADS, when set, decides instead.
  if (!std::getenv("OMP_NUM_THREADS")) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    at::set_num_threads(std::max(1, cores / std::max(1, launch_.local_world_size)));
  }
  const auto timeout = timeout_of(config_);
  if (launch_.world_size == 1) {
    store_ = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(launch_.master_port);
    options.isServer = launch_.rank == 0 && !launch_.store_hosted_by_launcher;
    if (!launch_.store_hosted_by_launcher) options.numWorkers = launch_.world_size;
    options.waitWorkers = !launch_.store_hosted_by_launcher;
    options.timeout = timeout;
    // Rank 0 opens the listening socket itself, on MASTER_ADDR only: c10d would listen on every interface, and a
    // second job on the same port must fail here rather than find this one's store.
    if (options.isServer) options.masterListenFd = comm::listen_on(launch_.master_addr, launch_.master_port);
    const std::string where = launch_.master_addr + ":" + std::to_string(launch_.master_port);
    try {
      // c10d logs a connection that timed out with its exception's C++ frames before it throws; the error below
      // says what failed, once.
      const QuietLibTorchLog quiet;
      store_ = c10::make_intrusive<c10d::TCPStore>(launch_.master_addr, options);
      // torchrun's store outlives a restart of the workers: each attempt keeps its keys apart.
      if (launch_.store_hosted_by_launcher) store_ = c10::make_intrusive<c10d::PrefixStore>(launch_.store_prefix, store_);
    } catch (const std::exception& error) {
      throw comm::CommError("rendezvous at " + where + " failed for rank " + std::to_string(launch_.rank) + " of " +
                            std::to_string(launch_.world_size) + " (launched by " + launch_.launcher +
                            "): " + comm::brief_message(error) +
                            (options.isServer ? ""
                                              : " (rank 0 hosts the job's store there: did it start, and can this "
                                                "host reach MASTER_ADDR?)"));
    }
    check_job_identity(where);
    check_same_config();
    // Every process says what CUDA_VISIBLE_DEVICES shows it; a host's processes are assumed to have consecutive
    // ranks (as smprun, torchrun and Slurm's default block distribution give them), checked by the host name.
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    publish("visible_devices/" + std::to_string(launch_.rank), std::string(host) + "\n" + visible_devices());
    const int first = launch_.rank - launch_.local_rank;
    // A range that runs past the world (a launcher that gave no per-host count, so local_world_size is the world's)
    // cannot be this host's processes: the device is then chosen as without the exchange, alike on every host.
    if (may_have_own_gpu(config_, launch_) && first + launch_.local_world_size <= launch_.world_size) {
      std::vector<std::string> visible;
      for (int rank = first; rank < first + launch_.local_world_size; ++rank) {
        const std::string entry = fetch("visible_devices/" + std::to_string(rank));
        const auto newline = entry.find('\n');
        // A process of another host in this range: the ranks are not grouped by host, so nothing can be told.
        visible.push_back(entry.substr(0, newline) == host ? entry.substr(newline + 1) : "");
      }
      device_ = choose_device(config_, launch_, gpus_assigned_per_process(visible));
      nccl_ = device_.is_cuda() && nccl_for_gpus(config_);
    } else if (may_have_own_gpu(config_, launch_)) {
      device_ = choose_device(config_, launch_, false);
      nccl_ = device_.is_cuda() && nccl_for_gpus(config_);
    }
    // Every rank must move stage tensors the same way; hosts with different GPU counts could choose differently.
    const std::string transport = nccl_ ? "NCCL" : "Gloo";
    if (launch_.rank == 0) {
      publish("transport", transport);
    } else if (const std::string chosen = fetch("transport"); chosen != transport) {
      throw ConfigError(config_.source + ": rank " + std::to_string(launch_.rank) + " would use " + transport +
                        " on " + device_.str() + " but rank 0 uses " + chosen +
                        " (hosts with different GPU counts?); set \"device\" and \"backend\" explicitly");
    }
  }
  if (config_.backend == "nccl" && !device_.is_cuda()) {
    // "device": "cpu" with "nccl" is refused with the config; "auto" found no GPU per process, and an explicit
    // "nccl" taken as Gloo would be a silent change of what was asked.
    throw ConfigError(config_.source + ": \"nccl\" (key \"backend\" or \"ddp_dist_backend\") moves GPU tensors "
                      "only, and \"device\": \"auto\" chose the CPU on rank " + std::to_string(launch_.rank) +
                      " (it sees " + std::to_string(torch::cuda::device_count()) + " CUDA device(s) for its host's " +
                      std::to_string(launch_.local_world_size) + " processes): use \"gloo\" or \"auto\", or "
                      "run where each process has a GPU");
  }
  // Through the device-generic interface: this file builds against a CPU-only LibTorch too.
  if (device_.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device_);
  // Gloo listens where the peers can reach this host: loopback for one-host jobs, else the address that routes
  // to rank 0 (GLOO_SOCKET_IFNAME, when set, overrides both).
  bind_host_ = launch_.world_size == 1 || launch_.master_is_loopback()
                   ? "127.0.0.1"
                   : comm::local_address_towards(launch_.master_addr);
  std::vector<int> everyone(launch_.world_size);
  for (int rank = 0; rank < launch_.world_size; ++rank) everyone[rank] = rank;
  // The world group carries control values (losses, flags) that live on the CPU.
  world_ = comm::make_gloo_group(store_, everyone, launch_.rank, "world", bind_host_, timeout_of(config_));
  groups_.push_back(world_);
  make_layout_groups("");
  if (launch_.rank == 0) {
    log::info("config " + config_.source + ": " + config_.describe());
    log::info(topology_.describe() + " (launched by " + launch_.launcher + ")");
    const bool shared = nccl_ && device_.is_cuda() && launch_.local_world_size > torch::cuda::device_count();
    log::info("device " + device_.str() + ", " +
              (nccl_ ? "NCCL " + nccl_version_text(comm::nccl_version()) : std::string("Gloo")) + " between ranks" +
              (shared ? " (several ranks per GPU: NCCL_MULTI_RANK_GPU_ENABLE=1)" : ""));
  }
}

void Runtime::make_layout_groups(const std::string& prefix) {
  const auto pipeline_members = topology_.group(Axis::pipeline, coordinates_);
  pipeline_ = make_group(pipeline_members, prefix + "pipeline/" + join(pipeline_members));
  const auto replica_members = topology_.group(Axis::data, coordinates_);
  data_parallel_ = make_group(replica_members, prefix + "data_parallel/" + join(replica_members));
  const auto shard_members = topology_.group(Axis::tensor, coordinates_);
  tensor_parallel_ = in_compute_group(shard_members, prefix + "tensor_parallel");
  tp::use_as_process_group(tensor_parallel_);  // what the tensor-parallel operators use by default
  expert_parallel_ = in_compute_group(topology_.expert_parallel_group(coordinates_), prefix + "expert_parallel");
  replica_statistics_.reset();  // a later layout's replicas are others: made again when asked for
  use_as_replica_group(nullptr);
  if (topology_.expert_parallel_degree() == 1) {
    expert_data_parallel_ = data_parallel_;
  } else {
    const auto holders = topology_.expert_data_parallel_group(coordinates_);
    expert_data_parallel_ = make_group(holders, prefix + "expert_data_parallel/" + join(holders));
  }
}

std::shared_ptr<comm::Communicator> Runtime::in_compute_group(const std::vector<int>& members,
                                                              const std::string& name) {
  // Overlapped forwards and backwards post the collectives inside their compute from two threads: each thread its
  // own communicator of the group (laned_communicator.h).
  auto group = make_group(members, name + "/" + join(members));
  if (!config_.overlap_forward_backward || members.size() < 2) return group;
  return comm::make_laned(std::move(group), make_group(members, name + "/second_lane/" + join(members)));
}

void Runtime::use_replica_statistics() {
  if (replica_statistics_) return;
  const auto members = topology_.group(Axis::data, coordinates_);
  // A group of its own, not data_parallel(): the gradient reducer's all-reduces are posted there as buckets fill,
  // and a statistic's sum must not wait behind them, nor be posted in another order beside them.
  const std::string prefix = layout_generation_ > 0 ? "layout" + std::to_string(layout_generation_) + "/" : "";
  replica_statistics_ = in_compute_group(members, prefix + "replica_statistics");
  use_as_replica_group(replica_statistics_);
}

void Runtime::adopt_layout(const Config& chosen) {
  if (config_.auto_keys.empty()) {
    throw ConfigError(config_.source + ": the layout was chosen already (no \"auto\" keys are left to plan)");
  }
  if (!chosen.auto_keys.empty()) {
    throw ConfigError(chosen.source + ": a chosen layout cannot leave keys \"auto\" (" + chosen.auto_keys.front() + ")");
  }
  Topology topology(chosen, launch_.world_size);
  // Every rank adopts the same layout at once; the groups of the provisional one go, and the new ones take names
  // of their own in the store.
  config_ = chosen;
  topology_ = topology;
  coordinates_ = topology_.coordinates_of(launch_.rank);
  ++layout_generation_;
  make_layout_groups("layout" + std::to_string(layout_generation_) + "/");
  if (launch_.rank == 0) {
    log::info("layout chosen: " + config_.describe());
    log::info(topology_.describe());
  }
}

std::shared_ptr<comm::Communicator> Runtime::make_group(const std::vector<int>& members, const std::string& name) {
  auto host = comm::make_gloo_group(store_, members, launch_.rank, name, bind_host_, timeout_of(config_), device_);
  auto group = nccl_ ? comm::make_nccl_group(store_, std::move(host), device_) : std::move(host);
  groups_.push_back(group);
  return group;
}

void Runtime::with_peers(const std::string& what, const std::function<void()>& work) {
  try {
    work();
  } catch (...) {
    std::string error = "an unknown error";
    try {
      throw;
    } catch (const std::exception& thrown) {
      error = thrown.what();
    } catch (...) {
    }
    // The first line says what failed; tracebacks and such stay with this rank's own error.
    error = error.substr(0, std::min<std::size_t>(error.find('\n'), 1000));
    // Failing because a peer left, this rank passes on where the failure began, not one more level of "left".
    const std::size_t origin = error.rfind(" left the job: ");
    const std::size_t origin_rank = origin == std::string::npos ? origin : error.rfind("rank ", origin);
    if (origin_rank != std::string::npos) {
      leave_job(what + " failed on rank " + std::to_string(launch_.rank) + " after " + error.substr(origin_rank));
    } else {
      leave_job(what + " failed on rank " + std::to_string(launch_.rank) + ": " + error);
    }
    throw;
  }
}

void Runtime::refuse_after_leaving(const std::string& caller) const {
  if (left_job_) {
    throw comm::CommError(caller + ": this rank left the job when " + *left_job_ +
                          "; its peers are out of step with it, so no step can run in this job again: end the job "
                          "and resume from the last checkpoint");
  }
}

void Runtime::leave_job(const std::string& reason) {
  if (left_job_ || launch_.world_size == 1) return;
  left_job_ = reason;
  // Not "out of step": a peer that died is the common cause, and the reason says which it was.
  log::error("rank " + std::to_string(launch_.rank) + " leaves the job (no step can run in it again): " + reason);
  for (const auto& made : groups_) {
    if (const auto group = made.lock()) group->leave(reason);
  }
}

void Runtime::check_job_identity(const std::string& where) {
  const char* job = std::getenv("SMP_JOB_ID");
  if (!job) job = std::getenv("TORCHELASTIC_RUN_ID");
  const std::string mine = job && std::string(job) != "none" ? job : "";
  if (launch_.rank == 0) {
    publish("job_id", mine);
    return;
  }
  const std::string theirs = fetch("job_id");
  if (!mine.empty() && !theirs.empty() && mine != theirs) {
    throw comm::CommError("the rendezvous store at " + where + " belongs to another job (job id " + theirs +
                          ", this job " + mine + "); pick another port (smprun's --master-port, or MASTER_PORT)");
  }
}

namespace {

std::string schedule_file_contents(const Config& config) {
  if (config.schedule_file.empty()) return "";
  std::ifstream file(config.schedule_file);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

}  // namespace

void Runtime::check_same_config() {
  if (launch_.rank == 0) {
    publish("config_schedule_file", schedule_file_contents(config_));
    publish("config", config_.text);
    return;
  }
  const std::string theirs = fetch("config");
  if (theirs == config_.text) return;
  const auto smp_keys = [](const std::string& text) {
    nlohmann::json document = nlohmann::json::parse(text, nullptr, false);
    if (document.is_object() && document.contains("smp") && document["smp"].is_object()) return document["smp"];
    return document.is_object() ? document : nlohmann::json::object();
  };
  nlohmann::json mine = smp_keys(config_.text), first = smp_keys(theirs);
  // Keys that may differ in their text but not their meaning: how much a rank logs, how long it waits, where it
  // writes its trace (given on every rank or none: rank 0 gathers every rank's), a schedule file each rank wrote
  // for itself (compared by the contents rank 0 published).
  for (const char* key : {"log_level", "comm_timeout_s"}) {
    mine.erase(key);
    first.erase(key);
  }
  if (mine.contains("trace_dir") && first.contains("trace_dir")) {
    mine.erase("trace_dir");
    first.erase("trace_dir");
  }
  if (mine.contains("schedule_file") && first.contains("schedule_file")) {
    mine["schedule_file"] = schedule_file_contents(config_);
    first["schedule_file"] = fetch("config_schedule_file");
  }
  std::string differences;
  for (const auto& [key, value] : mine.items()) {
    const std::string there = first.contains(key) ? first[key].dump() : "not given";
    if (first.contains(key) && first[key] == value) continue;
    differences += (differences.empty() ? "" : ", ") +
                   (key == "schedule_file" && first.contains(key)
                        ? std::string("\"schedule_file\" of other contents than rank 0's")
                        : "\"" + key + "\" " + value.dump() + " here, " + there + " on rank 0");
  }
  for (const auto& [key, value] : first.items()) {
    if (!mine.contains(key)) {
      differences += (differences.empty() ? "" : ", ") + ("\"" + key + "\" not given here, " + value.dump() +
                                                         " on rank 0");
    }
  }
  if (differences.empty()) return;  // the same smp keys (another application section, other spacing)
  throw ConfigError(config_.source + ": rank " + std::to_string(launch_.rank) + "'s config differs from rank 0's: " +
                    differences + "; every rank must read the same config");
}

void Runtime::publish(const std::string& key, const std::string& value) {
  store_->set("smp/" + key, std::vector<uint8_t>(value.begin(), value.end()));
}

void Runtime::forget(const std::string& key) { store_->deleteKey("smp/" + key); }

bool Runtime::published(const std::string& key) { return store_->check({"smp/" + key}); }

std::int64_t Runtime::count(const std::string& key, std::int64_t by) { return store_->add("smp/" + key, by); }

std::string Runtime::fetch(const std::string& key) {
  try {
    const auto bytes = store_->get("smp/" + key);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception& error) {
    // Rank 0 publishes most keys ("visible_devices/N" comes from rank N) and holds the store itself.
    const std::string reason = comm::brief_message(error);
    std::string hint;
    if (reason.find("closed") != std::string::npos || reason.find("reset") != std::string::npos) {
      hint = " (rank 0 holds the job's store: did it exit or fail?)";
    } else if (reason.find("timeout") != std::string::npos || reason.find("timed out") != std::string::npos) {
      hint = " (another rank, most often rank 0, publishes it and did not within comm_timeout_s: is it alive, stuck, "
             "or running another program?)";
    }
    throw comm::CommError("rank " + std::to_string(rank()) + " waited for \"" + key + "\" in the rendezvous store: " +
                          reason + hint);
  }
}

std::string Runtime::from_rank0(const std::string& key, const std::function<std::string()>& make) {
  if (rank() == 0) {
    std::string value;
    try {
      value = make();
    } catch (const std::exception& error) {
      // Its kind too: every rank raises what rank 0 does (a loop catching smp.ModelError catches it everywhere).
      const char* kind = dynamic_cast<const ModelError*>(&error)        ? "model"
                         : dynamic_cast<const CheckpointError*>(&error) ? "checkpoint"
                         : dynamic_cast<const comm::CommError*>(&error) ? "comm"
                                                                        : "config";
      publish(key, std::string("error\n") + kind + "\n" + error.what());
      // Rank 0 hosts the store, which ends with its process: the others read the error first (a dead one is not
      // waited for past a few seconds).
      try {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (store_->add("smp/" + key + "/error_read", 0) < world_size() - 1 &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      } catch (const std::exception&) {  // the store's trouble must not replace the error it carries
      }
      throw;
    }
    publish(key, "value\n" + value);
    return value;
  }
  const std::string message = fetch(key);
  const auto newline = message.find('\n');
  if (message.compare(0, newline, "value") != 0) {
    try {
      store_->add("smp/" + key + "/error_read", 1);
    } catch (const std::exception&) {  // rank 0 gone already: its error is what matters
    }
    const auto kind_end = message.find('\n', newline + 1);
    const std::string kind = message.substr(newline + 1, kind_end - newline - 1);
    const std::string why = "rank 0 failed: " + message.substr(kind_end + 1);
    if (kind == "model") throw ModelError(why);
    if (kind == "checkpoint") throw CheckpointError(why);
    if (kind == "comm") throw comm::CommError(why);
    throw ConfigError(why);
  }
  return message.substr(newline + 1);
}

at::Tensor Runtime::replica_slice(const at::Tensor& global_batch, bool fill_microbatches) const {
  const int replicas = topology_.data_parallel_degree();
  const int64_t size = global_batch.dim() > 0 ? global_batch.size(0) : 0;
  if (fill_microbatches) {
    try {
      config_.check_batch(static_cast<int>(size), replicas, true);
    } catch (const ConfigError& error) {
      throw ConfigError(std::string("replica_slice: ") + error.what() +
                        " (an evaluation's short batch, which evaluate takes: replica_slice(batch, "
                        "fill_microbatches=false))");
    }
  } else if (size < 1) {
    throw ConfigError(global_batch.dim() == 0 ? "replica_slice: a global batch without a batch dimension"
                                              : "replica_slice: a global batch of no samples");
  }
  if (config_.global_batch_size > 0 && size > config_.global_batch_size && !said_batch_differs_ && rank() == 0) {
    // Not refused, nor said of a smaller batch (an epoch's last, a validation set's rest). But the layout was
    // checked, and an "auto" one planned, for the config's size, and more samples hold more memory.
    said_batch_differs_ = true;
    log::warn("a step's batch has " + std::to_string(size) + " samples, the config's global_batch_size " +
              std::to_string(config_.global_batch_size) + " (what the layout was checked and planned for); said once");
  }
  // As at::tensor_split: the first replicas a sample more where the batch does not split evenly.
  const int64_t share = size / replicas, left = size % replicas, replica = dp_rank();
  return global_batch.narrow(0, share * replica + std::min(replica, left), share + (replica < left ? 1 : 0));
}

}  // namespace smp
