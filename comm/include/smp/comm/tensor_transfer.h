#pragma once
// Transfers of tensor lists whose shapes the receiver does not know in advance: a fixed-size header message
// (count, dtypes, shapes) and then one message per tensor. Shapes may change from step to step. The header is a
// CPU tensor (matched by tag); the tensors are received on the group's device.

#include <memory>
#include <string>
#include <vector>

#include "smp/comm/communicator.h"

namespace smp::comm {

// Tags of one transfer are [tag, tag + kTagsPerTransfer): the header and up to kTagsPerTransfer - 1 tensors.
constexpr int kTagsPerTransfer = 16;

// Posts the header and every tensor; the tensors are kept alive by the returned Pending.
std::unique_ptr<Pending> send_tensors(Communicator& comm, const std::vector<at::Tensor>& tensors, int peer, int tag,
                                      const std::string& what);

// Posts the header receive at construction, so it can be done ahead of the compute that needs the tensors.
class IncomingTensors {
 public:
  IncomingTensors(Communicator& comm, int peer, int tag, std::string what);
  // Waits for the header, receives the tensors, returns them. Call once.
  std::vector<at::Tensor> wait();

 private:
  Communicator& comm_;
  int peer_;
  int tag_;
  std::string what_;
  at::Tensor header_;
  std::unique_ptr<Pending> header_receive_;
};

}  // namespace smp::comm
