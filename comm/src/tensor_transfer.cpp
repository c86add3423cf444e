#include "smp/comm/tensor_transfer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

namespace smp::comm {
namespace {

// Header layout (int64): [magic, count, then per tensor: dtype, ndim, dims...].
constexpr int64_t kHeaderMagic = 0x736d7001;  // "smp" + format version 1
constexpr int kHeaderSlots = 64;
constexpr int kMaxDims = 8;

at::Tensor make_header(const std::vector<at::Tensor>& tensors, const std::string& what) {
  if (static_cast<int>(tensors.size()) > kTagsPerTransfer - 1) {
    throw CommError(what + ": " + std::to_string(tensors.size()) + " tensors in one transfer; at most " +
                    std::to_string(kTagsPerTransfer - 1) + " are supported");
  }
  at::Tensor header = at::zeros({kHeaderSlots}, at::kLong);
  auto* slot = header.data_ptr<int64_t>();
  int used = 0;
  slot[used++] = kHeaderMagic;
  slot[used++] = static_cast<int64_t>(tensors.size());
  for (const auto& tensor : tensors) {
    if (tensor.dim() > kMaxDims || used + 2 + tensor.dim() > kHeaderSlots) {
      throw CommError(what + ": tensor shapes too large for the transfer header (at most " + std::to_string(kMaxDims) +
                      " dimensions each)");
    }
    slot[used++] = static_cast<int64_t>(tensor.scalar_type());
    slot[used++] = tensor.dim();
    for (int64_t size : tensor.sizes()) slot[used++] = size;
  }
  return header;
}

// An in-order transport matches payloads by their order between two ranks, not by tag: they all carry the first
// payload tag (never a header's, which are multiples of kTagsPerTransfer).
int payload_tag(const Communicator& comm, int tag, std::size_t index) {
  return comm.in_order() ? 1 : tag + 1 + static_cast<int>(index);
}

}  // namespace

std::unique_ptr<Pending> send_tensors(Communicator& comm, const std::vector<at::Tensor>& tensors, int peer, int tag,
                                      const std::string& what) {
  class Group final : public Pending {
   public:
    std::vector<std::unique_ptr<Pending>> parts;
    void wait() override {
      for (auto& part : parts) part->wait();
      parts.clear();
    }
  };
  auto group = std::make_unique<Group>();
  group->parts.push_back(comm.isend(make_header(tensors, what), peer, tag));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    // Payloads travel on the group's device, where the receiver makes its buffers (on a GPU, over NCCL): a tensor a
    // module left on the CPU would otherwise go over Gloo into a receive posted on NCCL, and never arrive.
    group->parts.push_back(comm.isend(tensors[i].to(comm.device()).contiguous(), peer, payload_tag(comm, tag, i)));
  }
  return group;
}

IncomingTensors::IncomingTensors(Communicator& comm, int peer, int tag, std::string what)
    : comm_(comm), peer_(peer), tag_(tag), what_(std::move(what)), header_(at::empty({kHeaderSlots}, at::kLong)) {
  header_receive_ = comm_.irecv(header_, peer_, tag_);
}

std::vector<at::Tensor> IncomingTensors::wait() {
  try {
    header_receive_->wait();
  } catch (const CommError& error) {
    throw CommError(what_ + ": " + error.what());
  }
  const auto* slot = header_.data_ptr<int64_t>();
  auto malformed = [&](const std::string& problem) {
    return CommError(what_ + ": malformed transfer header from rank " + std::to_string(comm_.global_rank(peer_)) +
                     " (" + problem + "); are both sides running the same program?");
  };
  if (slot[0] != kHeaderMagic) throw malformed("bad magic number");
  const int64_t count = slot[1];
  if (count < 0 || count > kTagsPerTransfer - 1) throw malformed("tensor count " + std::to_string(count));
  std::vector<at::Tensor> tensors;
  std::vector<std::unique_ptr<Pending>> receives;
  int used = 2;
  for (int64_t i = 0; i < count; ++i) {
    if (used + 2 > kHeaderSlots) throw malformed("truncated");
    const int64_t dtype = slot[used++];
    const int64_t ndim = slot[used++];
    if (dtype < 0 || dtype >= static_cast<int64_t>(at::ScalarType::NumOptions)) throw malformed("dtype");
    if (ndim < 0 || ndim > kMaxDims || used + ndim > kHeaderSlots) throw malformed("rank " + std::to_string(ndim));
    std::vector<int64_t> sizes(slot + used, slot + used + ndim);
    used += static_cast<int>(ndim);
    for (int64_t size : sizes) {
      if (size < 0) throw malformed("negative size");
    }
    tensors.push_back(
        at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)).device(comm_.device())));
    receives.push_back(comm_.irecv(tensors.back(), peer_, payload_tag(comm_, tag_, static_cast<std::size_t>(i))));
  }
  for (auto& receive : receives) {
    try {
      receive->wait();
    } catch (const CommError& error) {
      throw CommError(what_ + ": " + error.what());
    }
  }
  return tensors;
}

}  // namespace smp::comm
