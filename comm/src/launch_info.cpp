#include "smp/comm/launch_info.h"

#include <cstdlib>
#include <string>

#include "smp/comm/communicator.h"

namespace smp::comm {
namespace {

int parse_int(const char* name, const char* value, int low, int high) {
  char* end = nullptr;
  errno = 0;
  const long number = std::strtol(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || number < low || number > high) {
    throw CommError(std::string("environment variable ") + name + "=\"" + value + "\" is not an integer in [" +
                    std::to_string(low) + ", " + std::to_string(high) + "]");
  }
  return static_cast<int>(number);
}

}  // namespace

LaunchInfo LaunchInfo::from_environment(const std::function<const char*(const char*)>& lookup_or_null) {
  const auto lookup = lookup_or_null ? lookup_or_null : [](const char* name) -> const char* { return std::getenv(name); };
  struct Variables {
    const char* launcher;
    const char* rank;
    const char* world_size;
    const char* local_rank;
    const char* local_world_size;
  };
  static const Variables kLaunchers[] = {
      // torchrun's and smprun's variables, which a site's own launcher may set as well: named as what was read.
      {"RANK and WORLD_SIZE: torchrun, smprun or a launcher of the site's", "RANK", "WORLD_SIZE", "LOCAL_RANK",
       "LOCAL_WORLD_SIZE"},
      {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  LaunchInfo info;
  const Variables* found = nullptr;
  for (const auto& candidate : kLaunchers) {
    if (lookup(candidate.rank) && lookup(candidate.world_size)) {
      found = &candidate;
      break;
    }
  }
  if (!found) {
    // torchrun's and smprun's variables only: an salloc shell sets SLURM_NTASKS for the processes srun would start,
    // not for a program run in it directly.
    for (const auto& candidate : {kLaunchers[0]}) {
      const char* world_size = lookup(candidate.world_size);
      if (world_size && std::string(world_size) != "1" && std::string(world_size) != "0") {
        throw CommError(std::string("environment variable ") + candidate.world_size + "=\"" + world_size +
                        "\" is set but " + candidate.rank + " is not: set both (each process its own " +
                        candidate.rank + "), or neither for a one-process job");
      }
    }
    // Run directly, without a launcher: a one-process job that needs no rendezvous.
    info.launcher = "none (single process)";
    return info;
  }
  info.launcher = found->launcher;
  info.world_size = parse_int(found->world_size, lookup(found->world_size), 1, 1 << 20);
  info.rank = parse_int(found->rank, lookup(found->rank), 0, info.world_size - 1);
  const char* local_rank = lookup(found->local_rank);
  info.local_rank = local_rank ? parse_int(found->local_rank, local_rank, 0, 1 << 20) : 0;
  const char* local_world_size = lookup(found->local_world_size);
  // Slurm writes e.g. "4(x2)" for heterogeneous nodes; only a plain number is taken, else assume one host.
  info.local_world_size = info.world_size;
  if (local_world_size && std::string(local_world_size).find_first_not_of("0123456789") == std::string::npos) {
    info.local_world_size = parse_int(found->local_world_size, local_world_size, 1, 1 << 20);
  }
  if (info.world_size > 1) {
    const char* addr = lookup("MASTER_ADDR");
    // smprun's store port; MASTER_PORT is then the program's own torch.distributed's. Under torchrun its agent's
    // store on MASTER_PORT is the one (an SMP_MASTER_PORT there is inherited from an outer smprun).
    const char* agent = lookup("TORCHELASTIC_USE_AGENT_STORE");
    const char* smp_port = agent ? nullptr : lookup("SMP_MASTER_PORT");
    const char* port = smp_port ? smp_port : lookup("MASTER_PORT");
    const char* port_variable = smp_port ? "SMP_MASTER_PORT" : "MASTER_PORT";
    if (!addr || !*addr) {
      throw CommError(std::string("MASTER_ADDR is not set (launched by ") + info.launcher +
                      "); set it to the host of rank 0");
    }
    if (!port) throw CommError(std::string("MASTER_PORT is not set (launched by ") + info.launcher + ")");
    info.master_addr = addr;
    info.master_port = parse_int(port_variable, port, 1, 65535);
    const char* agent_store = lookup("TORCHELASTIC_USE_AGENT_STORE");
    if (!smp_port && agent_store && (std::string(agent_store) == "True" || std::string(agent_store) == "true" ||
                        std::string(agent_store) == "1")) {
      info.store_hosted_by_launcher = true;
      const char* restarts = lookup("TORCHELASTIC_RESTART_COUNT");
      info.store_prefix = std::string("smp_attempt_") + (restarts ? restarts : "0");
    }
  }
  return info;
}

bool LaunchInfo::master_is_loopback() const {
  return master_addr == "localhost" || master_addr == "::1" || master_addr.rfind("127.", 0) == 0;
}

}  // namespace smp::comm
