#pragma once
// Who this process is in the job, read from the launcher's environment: smprun and torchrun
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), Open MPI's mpirun (OMPI_COMM_WORLD_*), or Slurm's
// srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID). MASTER_ADDR/MASTER_PORT are always needed. A world size above 1
// without a rank is refused (a half-set environment would otherwise run as a one-process job).

#include <functional>
#include <string>

namespace smp::comm {

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  // processes on this host, when the launcher says (else world_size)
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string launcher;  // which set of variables was read, for messages
  // torchrun's agent already hosts a store on MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): every rank
  // joins it as a client, under a prefix of its own per restart (TORCHELASTIC_RESTART_COUNT), rather than rank 0
  // hosting one there.
  bool store_hosted_by_launcher = false;
  std::string store_prefix;

  // `lookup` returns the variable's value or nullptr; defaults to getenv. Throws CommError naming the variable
  // that is missing or malformed.
  static LaunchInfo from_environment(const std::function<const char*(const char*)>& lookup = nullptr);
  bool master_is_loopback() const;
};

}  // namespace smp::comm
