#pragma once
// What every rank needs before it is forked: a rendezvous port, its environment, and a program that exists.

#include <functional>
#include <string>
#include <vector>

namespace smp::launch {

// Binds a TCP socket to port 0 on `address` (numeric or a host name), reads back the port the kernel chose
// and closes the socket. Throws std::runtime_error when nothing can be bound there, e.g. a remote address.
int pick_free_port(const std::string& address);

// `base` ("NAME=value" entries) with the rendezvous variables replaced by this rank's values; everything
// else, OMP_NUM_THREADS included, is kept as given. smp's store listens on `master_port` (SMP_MASTER_PORT);
// MASTER_PORT is `torch_port`, left to the program's own torch.distributed.init_process_group (env://), which
// would otherwise find smp's store on it.
// With several nodes, `local_rank` and `local_world_size` are this node's and the global rank is
// node_rank * local_world_size + local_rank. A non-empty job_id is exported as SMP_JOB_ID.
std::vector<std::string> rank_environment(const std::vector<std::string>& base, int local_rank, int local_world_size,
                                          const std::string& master_addr, int master_port, int torch_port,
                                          int node_rank = 0, int nodes = 1, const std::string& job_id = "");

// The port MASTER_PORT gives torch.distributed beside smp's `master_port`: a free one on one node (`picked` by
// pick_free_port), the next one up where every node must derive the same (several nodes).
int torch_port_beside(int master_port, int nodes, const std::function<int()>& picked);

// Checks, the way execvp searches, that `program` names an executable file: a path when it contains a '/',
// otherwise a PATH lookup (`path_variable` null: the default search path). Returns 0 or the errno that
// execvp would fail with (ENOENT, EACCES).
int check_executable(const std::string& program, const char* path_variable);

}  // namespace smp::launch
