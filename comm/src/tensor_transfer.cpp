#include "smp/comm/tensor_transfer.h"

#include <algorithm>
#include <iterator>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

namespace smp::comm {
namespace {

// Header layout (int64): [magic, count, kind, stamp's call, stamp's batch, then per tensor: dtype and memory format
// (format_code << 8 | dtype), ndim, dims...]; a packed transfer's: [magic, count, kPacked, call, batch, layout
// message's length, payload's bytes].
constexpr int64_t kHeaderMagic = 0x736d7004;  // "smp" + format version 4
constexpr int kLayoutSlot = 5;
constexpr int kHeaderSlots = 72;  // 64 of layout, as before the stamp took two
constexpr int kMaxDims = 8;
// Where the payloads go: to the receives posted ahead for the remembered layout, or to tags of their own; or, for
// a layout the header cannot describe (more tensors, or more dimensions, than it has room for: a cut across a dense
// block's many feature maps), the layout as a message of its own and every tensor packed into one payload.
constexpr int64_t kAsExpected = 0;
constexpr int64_t kNewLayout = 1;
constexpr int64_t kPacked = 2;
constexpr int64_t kPackAlignment = 64;  // each tensor's bytes start aligned, so that they can be viewed as its type

bool fits_header(const std::vector<at::Tensor>& tensors) {
  if (static_cast<int>(tensors.size()) > kMaxTensorsPerTransfer) return false;
  int used = kLayoutSlot;
  for (const auto& tensor : tensors) {
    if (tensor.dim() > kMaxDims) return false;
    used += 2 + static_cast<int>(tensor.dim());
  }
  return used <= kHeaderSlots;
}

int64_t packed_bytes(const TensorLayout& tensor) {
  int64_t bytes = static_cast<int64_t>(c10::elementSize(tensor.dtype));
  for (auto size : tensor.sizes) bytes *= size;
  return bytes;
}

int64_t aligned(int64_t offset) { return (offset + kPackAlignment - 1) / kPackAlignment * kPackAlignment; }

// The layout message of a packed transfer travels on the transfer's last tag, which no payload uses.
int layout_tag(int tag) { return tag + kTagsPerTransfer - 1; }

std::vector<TensorLayout> layout_of(const std::vector<at::Tensor>& tensors) {
  std::vector<TensorLayout> layout;
  for (const auto& tensor : tensors) {
    layout.push_back({tensor.scalar_type(), tensor.sizes().vec(), transferred_format(tensor)});
  }
  return layout;
}

constexpr c10::MemoryFormat kFormats[] = {c10::MemoryFormat::Contiguous, c10::MemoryFormat::ChannelsLast,
                                          c10::MemoryFormat::ChannelsLast3d};

int64_t dtype_and_format(const TensorLayout& tensor) {
  const auto code = std::find(std::begin(kFormats), std::end(kFormats), tensor.format) - std::begin(kFormats);
  return static_cast<int64_t>(tensor.dtype) | static_cast<int64_t>(code) << 8;
}

// The memory of a tensor dense in `format`, as one contiguous tensor of its elements in their order there (a
// view: a receive into it fills the tensor). The communicators send and receive contiguous tensors; they would
// make a channels_last one contiguous in the default format, reordering its bytes.
at::Tensor in_memory_order(const at::Tensor& tensor, c10::MemoryFormat format) {
  if (format == c10::MemoryFormat::ChannelsLast) return tensor.permute({0, 2, 3, 1}).view(-1);
  if (format == c10::MemoryFormat::ChannelsLast3d) return tensor.permute({0, 2, 3, 4, 1}).view(-1);
  return tensor;
}

// A tensor's bytes as they travel: dense in its transferred format, on the group's device.
at::Tensor as_sent(const at::Tensor& tensor, c10::MemoryFormat format, c10::Device device) {
  return in_memory_order(tensor.to(device).contiguous(format), format);
}

// Only for tensors that fit_header.
at::Tensor make_header(const std::vector<at::Tensor>& tensors, int64_t kind, TransferStamp stamp) {
  at::Tensor header = at::zeros({kHeaderSlots}, at::kLong);
  auto* slot = header.data_ptr<int64_t>();
  int used = 0;
  slot[used++] = kHeaderMagic;
  slot[used++] = static_cast<int64_t>(tensors.size());
  slot[used++] = kind;
  slot[used++] = stamp.call;
  slot[used++] = stamp.batch;
  for (const auto& tensor : layout_of(tensors)) {
    slot[used++] = dtype_and_format(tensor);
    slot[used++] = static_cast<int64_t>(tensor.sizes.size());
    for (int64_t size : tensor.sizes) slot[used++] = size;
  }
  return header;
}

// Whether this channel remembers layouts: an in-order transport (NCCL) matches payloads by their order between two
// ranks, not by tag, so receives posted ahead would take whatever comes first.
bool remembers(const Communicator& comm, const TransferLayouts* layouts) { return layouts && !comm.in_order(); }

int expected_tag(int tag, std::size_t index) { return tag + 1 + static_cast<int>(index); }
// On an in-order transport every payload carries the first payload tag (never a header's, which are multiples of
// kTagsPerTransfer).
int new_layout_tag(const Communicator& comm, int tag, std::size_t index) {
  return comm.in_order() ? 1 : tag + 1 + kMaxTensorsPerTransfer + static_cast<int>(index);
}

std::vector<at::Tensor> allocate(const std::vector<TensorLayout>& layout, c10::Device device) {
  std::vector<at::Tensor> tensors;
  for (const auto& tensor : layout) {
    tensors.push_back(
        at::empty(tensor.sizes, at::TensorOptions().dtype(tensor.dtype).device(device).memory_format(tensor.format)));
  }
  return tensors;
}

}  // namespace

c10::MemoryFormat transferred_format(const at::Tensor& tensor) {
  // By the strides' order, as PyTorch's kernels choose their output's format: a channels_last [N, C, 1, 1] (a
  // squeeze-excite's pooled map) is contiguous too, and a channel chunk of a channels_last map dense in neither.
  if (tensor.dim() != 4 && tensor.dim() != 5) return c10::MemoryFormat::Contiguous;
  return tensor.suggest_memory_format();
}

const std::vector<TensorLayout>* TransferLayouts::find(int peer, int tag) const {
  const auto found = layouts_.find({peer, tag});
  return found == layouts_.end() ? nullptr : &found->second;
}

std::unique_ptr<Pending> send_tensors(Communicator& comm, const std::vector<at::Tensor>& tensors, int peer, int tag,
                                      const std::string& /*what*/, TransferLayouts* layouts, TransferStamp stamp) {
  class Group final : public Pending {
   public:
    std::vector<std::unique_ptr<Pending>> parts;
    void wait() override {
      for (auto& part : parts) part->wait();
      parts.clear();
    }
  };
  const bool remembering = remembers(comm, layouts);
  const std::vector<TensorLayout>* expected = remembering ? layouts->find(peer, tag) : nullptr;
  std::vector<TensorLayout> layout = layout_of(tensors);
  const bool packed = !fits_header(tensors);
  const bool as_expected = !packed && expected && *expected == layout;
  auto group = std::make_unique<Group>();
  int64_t packed_size = 0;  // bytes of the one payload of a packed transfer
  if (packed) {
    std::vector<int64_t> description;
    for (const auto& tensor : layout) {
      description.push_back(dtype_and_format(tensor));
      description.push_back(static_cast<int64_t>(tensor.sizes.size()));
      description.insert(description.end(), tensor.sizes.begin(), tensor.sizes.end());
      packed_size = aligned(packed_size) + packed_bytes(tensor);
    }
    at::Tensor header = at::zeros({kHeaderSlots}, at::kLong);
    auto* slot = header.data_ptr<int64_t>();
    slot[0] = kHeaderMagic;
    slot[1] = static_cast<int64_t>(tensors.size());
    slot[2] = kPacked;
    slot[3] = stamp.call;
    slot[4] = stamp.batch;
    slot[5] = static_cast<int64_t>(description.size());
    slot[6] = packed_size;
    group->parts.push_back(comm.isend(header, peer, tag));
    at::Tensor layout_message = at::empty({static_cast<int64_t>(description.size())}, at::kLong);
    std::copy(description.begin(), description.end(), layout_message.data_ptr<int64_t>());
    group->parts.push_back(comm.isend(layout_message, peer, layout_tag(tag)));
  } else {
    group->parts.push_back(comm.isend(make_header(tensors, as_expected ? kAsExpected : kNewLayout, stamp), peer, tag));
  }
  if (expected && !as_expected) {
    // The receives posted ahead for the old layout are retired with a byte each (a send may be smaller than its
    // receive, never larger: an empty buffer gets an empty message).
    for (std::size_t j = 0; j < expected->size(); ++j) {
      at::Tensor retire = at::zeros({std::min<std::int64_t>(packed_bytes((*expected)[j]), 1)},
                                    at::TensorOptions(at::kByte).device(comm.device()));
      group->parts.push_back(comm.isend(retire, peer, expected_tag(tag, j)));
    }
  }
  if (packed) {
    at::Tensor payload = at::empty({packed_size}, at::TensorOptions(at::kByte).device(comm.device()));
    int64_t offset = 0;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      offset = aligned(offset);
      const int64_t size = packed_bytes(layout[i]);
      if (size > 0) {
        // In the default format: the receiver gives each tensor its own after (receive_packed).
        payload.narrow(0, offset, size).copy_(tensors[i].to(comm.device()).contiguous().flatten().view(at::kByte));
      }
      offset += size;
    }
    group->parts.push_back(comm.isend(payload, peer, new_layout_tag(comm, tag, 0)));
    if (remembering) layouts->forget(peer, tag);
    return group;
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    // Payloads travel on the group's device, where the receiver makes its buffers (on a GPU, over NCCL): a tensor a
    // module left on the CPU would otherwise go over Gloo into a receive posted on NCCL, and never arrive.
    group->parts.push_back(comm.isend(as_sent(tensors[i], layout[i].format, comm.device()), peer,
                                      as_expected ? expected_tag(tag, i) : new_layout_tag(comm, tag, i)));
  }
  if (remembering) layouts->remember(peer, tag, std::move(layout));
  return group;
}

IncomingTensors::IncomingTensors(Communicator& comm, int peer, int tag, std::string what, TransferLayouts* layouts,
                                 TransferStamp stamp)
    : comm_(comm),
      peer_(peer),
      tag_(tag),
      what_(std::move(what)),
      layouts_(remembers(comm, layouts) ? layouts : nullptr),
      stamp_(stamp),
      header_(at::empty({kHeaderSlots}, at::kLong)) {
  header_receive_ = comm_.irecv(header_, peer_, tag_);
}

void IncomingTensors::post_expected() {
  if (expected_posted_) return;
  expected_posted_ = true;
  const std::vector<TensorLayout>* expected = layouts_ ? layouts_->find(peer_, tag_) : nullptr;
  if (!expected) return;
  expected_ = allocate(*expected, comm_.device());
  for (std::size_t j = 0; j < expected_.size(); ++j) {
    expected_receives_.push_back(
        comm_.irecv(in_memory_order(expected_[j], (*expected)[j].format), peer_, expected_tag(tag_, j)));
  }
}

std::vector<at::Tensor> IncomingTensors::wait() {
  const auto waited = [&](std::vector<std::unique_ptr<Pending>>& receives) {
    for (auto& receive : receives) {
      try {
        receive->wait();
      } catch (const CommError& error) {
        throw CommError(what_ + ": " + error.what());
      }
    }
    receives.clear();
  };
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
  const int64_t kind = slot[2];
  const TransferStamp sent{slot[3], slot[4]};
  const auto differ = [](int64_t theirs, int64_t ours) {
    return theirs != ours && theirs != kUnchecked && ours != kUnchecked;
  };
  if (differ(sent.call, stamp_.call) || differ(sent.batch, stamp_.batch)) {
    throw TransferOutOfStep(what_ + ": rank " + std::to_string(comm_.global_rank(peer_)) + " is out of step with this rank",
                            sent, stamp_);
  }
  if (kind == kPacked) return receive_packed(count, slot[5], slot[6]);
  if (count < 0 || count > kMaxTensorsPerTransfer) throw malformed("tensor count " + std::to_string(count));
  if (kind != kAsExpected && kind != kNewLayout) throw malformed("kind " + std::to_string(kind));
  std::vector<TensorLayout> layout = read_layout(slot + kLayoutSlot, kHeaderSlots - kLayoutSlot, count);
  // The sender sent to (or retired) the receives of the layout both ends remember: they must exist here, posted
  // now if this rank had not come to it.
  post_expected();
  std::vector<at::Tensor> tensors;
  if (kind == kAsExpected) {
    const std::vector<TensorLayout>* expected = layouts_ ? layouts_->find(peer_, tag_) : nullptr;
    if (!expected || *expected != layout) throw malformed("payloads sent to receives of another layout");
    waited(expected_receives_);
    tensors = std::move(expected_);
  } else {
    waited(expected_receives_);  // retired
    expected_.clear();
    tensors = allocate(layout, comm_.device());
    std::vector<std::unique_ptr<Pending>> receives;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      receives.push_back(
          comm_.irecv(in_memory_order(tensors[i], layout[i].format), peer_, new_layout_tag(comm_, tag_, i)));
    }
    waited(receives);
  }
  if (layouts_) layouts_->remember(peer_, tag_, std::move(layout));
  return tensors;
}

std::vector<TensorLayout> IncomingTensors::read_layout(const int64_t* slot, int64_t slots, int64_t count) const {
  auto malformed = [&](const std::string& problem) {
    return CommError(what_ + ": malformed transfer header from rank " + std::to_string(comm_.global_rank(peer_)) +
                     " (" + problem + "); are both sides running the same program?");
  };
  std::vector<TensorLayout> layout;
  int64_t used = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (used + 2 > slots) throw malformed("truncated");
    const int64_t dtype = slot[used] & 0xff, format = slot[used] >> 8;
    ++used;
    const int64_t ndim = slot[used++];
    if (dtype < 0 || dtype >= static_cast<int64_t>(at::ScalarType::NumOptions)) throw malformed("dtype");
    if (format < 0 || format >= static_cast<int64_t>(std::size(kFormats))) throw malformed("memory format");
    if (ndim < 0 || used + ndim > slots) throw malformed("rank " + std::to_string(ndim));
    std::vector<int64_t> sizes(slot + used, slot + used + ndim);
    used += ndim;
    for (int64_t size : sizes) {
      if (size < 0) throw malformed("negative size");
    }
    const c10::MemoryFormat memory_format = kFormats[format];
    if (memory_format != c10::MemoryFormat::Contiguous && ndim != (memory_format == c10::MemoryFormat::ChannelsLast ? 4 : 5)) {
      throw malformed("memory format of " + std::to_string(ndim) + " dimensions");
    }
    layout.push_back({static_cast<at::ScalarType>(dtype), std::move(sizes), memory_format});
  }
  return layout;
}

std::vector<at::Tensor> IncomingTensors::receive_packed(int64_t count, int64_t layout_slots, int64_t bytes) {
  const auto waited = [&](Pending& receive) {
    try {
      receive.wait();
    } catch (const CommError& error) {
      throw CommError(what_ + ": " + error.what());
    }
  };
  if (count < 0 || layout_slots < 0 || bytes < 0) {
    throw CommError(what_ + ": malformed transfer header from rank " + std::to_string(comm_.global_rank(peer_)) +
                    " (packed sizes); are both sides running the same program?");
  }
  // The receives posted ahead for the last layout were retired by the sender.
  post_expected();
  for (auto& receive : expected_receives_) waited(*receive);
  expected_receives_.clear();
  expected_.clear();
  at::Tensor description = at::empty({layout_slots}, at::kLong);
  waited(*comm_.irecv(description, peer_, layout_tag(tag_)));
  const std::vector<TensorLayout> layout = read_layout(description.data_ptr<int64_t>(), layout_slots, count);
  at::Tensor payload = at::empty({bytes}, at::TensorOptions(at::kByte).device(comm_.device()));
  waited(*comm_.irecv(payload, peer_, new_layout_tag(comm_, tag_, 0)));
  std::vector<at::Tensor> tensors;
  int64_t offset = 0;
  for (const auto& tensor : layout) {
    offset = aligned(offset);
    const int64_t size = packed_bytes(tensor);
    if (offset + size > bytes) {
      throw CommError(what_ + ": packed transfer from rank " + std::to_string(comm_.global_rank(peer_)) +
                      " is shorter than its layout; are both sides running the same program?");
    }
    // A tensor of its own (not a view of the payload): the engine gives each received tensor its own gradient.
    tensors.push_back(size == 0 ? at::empty(tensor.sizes, at::TensorOptions(tensor.dtype).device(comm_.device()))
                                : payload.narrow(0, offset, size).view(tensor.dtype).view(tensor.sizes).clone(
                                      tensor.format));
    offset += size;
  }
  if (layouts_) layouts_->forget(peer_, tag_);
  return tensors;
}

}  // namespace smp::comm
