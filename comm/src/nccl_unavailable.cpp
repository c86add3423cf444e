// Built instead of nccl_communicator.cpp when CMake found no NCCL (or no CUDA toolkit): CPU jobs work, and a
// job that asks for NCCL is told why it cannot have it.
#include "smp/comm/communicator.h"

namespace smp::comm {

bool nccl_available() { return false; }
int nccl_version() { return 0; }

std::shared_ptr<Communicator> make_nccl_group(const c10::intrusive_ptr<c10d::Store>&, std::shared_ptr<Communicator>,
                                              c10::Device device) {
  throw CommError("this build of smp has no NCCL (CMake found no nccl.h / libnccl), so " + device.str() +
                  " cannot use the nccl backend; rebuild with NCCL or set \"backend\": \"gloo\"");
}

}  // namespace smp::comm
