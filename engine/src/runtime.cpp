#include "smp/runtime.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "smp/log.h"

namespace smp {
namespace {

std::chrono::milliseconds timeout_of(const Config& config) {
  return std::chrono::milliseconds(static_cast<long long>(config.comm_timeout_s * 1000.0));
}

std::string join(const std::vector<int>& ranks) {
  std::string text;
  for (int rank : ranks) text += (text.empty() ? "" : ",") + std::to_string(rank);
  return text;
}

}  // namespace

std::shared_ptr<Runtime> Runtime::init(const Config& config) {
  return init(config, comm::LaunchInfo::from_environment());
}

std::shared_ptr<Runtime> Runtime::init(const Config& config, const comm::LaunchInfo& launch) {
  return std::shared_ptr<Runtime>(new Runtime(config, launch));
}

Runtime::Runtime(const Config& config, const comm::LaunchInfo& launch)
    : config_(config),
      launch_(launch),
      topology_(config, launch.world_size),
      coordinates_(topology_.coordinates_of(launch.rank)) {
  log::configure(launch_.rank, config_.log_level);
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
    options.isServer = launch_.rank == 0;
    options.numWorkers = launch_.world_size;
    options.waitWorkers = true;
    options.timeout = timeout;
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(launch_.master_addr, options);
    } catch (const std::exception& error) {
      throw comm::CommError("rendezvous at " + launch_.master_addr + ":" + std::to_string(launch_.master_port) +
                            " failed for rank " + std::to_string(launch_.rank) + " of " +
                            std::to_string(launch_.world_size) + " (launched by " + launch_.launcher +
                            "): " + comm::brief_message(error));
    }
  }
  const std::string bind_host = launch_.master_is_loopback() || launch_.world_size == 1 ? "127.0.0.1" : "";
  std::vector<int> everyone(launch_.world_size);
  for (int rank = 0; rank < launch_.world_size; ++rank) everyone[rank] = rank;
  world_ = comm::make_gloo_group(store_, everyone, launch_.rank, "world", bind_host, timeout);
  const auto pipeline_members = topology_.pipeline_group(coordinates_.dp_rank);
  pipeline_ = comm::make_gloo_group(store_, pipeline_members, launch_.rank,
                                    "pipeline/" + join(pipeline_members), bind_host, timeout);
  const auto replica_members = topology_.data_parallel_group(coordinates_.pp_rank);
  data_parallel_ = comm::make_gloo_group(store_, replica_members, launch_.rank,
                                         "data_parallel/" + join(replica_members), bind_host, timeout);
  if (launch_.rank == 0) {
    log::info("config " + config_.source + ": " + config_.describe());
    log::info(topology_.describe() + " (launched by " + launch_.launcher + ")");
  }
}

void Runtime::publish(const std::string& key, const std::string& value) {
  store_->set("smp/" + key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Runtime::fetch(const std::string& key) {
  try {
    const auto bytes = store_->get("smp/" + key);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception& error) {
    throw comm::CommError("rank " + std::to_string(rank()) + " waited for \"" + key + "\" from rank 0: " +
                          comm::brief_message(error));
  }
}

at::Tensor Runtime::replica_slice(const at::Tensor& global_batch) const {
  const int replicas = topology_.data_parallel_degree();
  const int64_t size = global_batch.size(0);
  config_.check_batch(static_cast<int>(size), replicas);
  const int64_t share = size / replicas;
  return global_batch.narrow(0, share * dp_rank(), share);
}

}  // namespace smp
