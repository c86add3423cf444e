#pragma once
// Transfers of tensor lists whose shapes the receiver does not know in advance: a fixed-size header message
// (count, dtypes, shapes) and then one message per tensor. Shapes may change from step to step. The header is a
// CPU tensor (matched by tag); the tensors are received on the group's device.
//
// Gloo sends a message's bytes only once the receiver has posted its receive (and said so): a payload receive posted
// after its header arrived costs two more trips across the wire. So both ends remember the layout (dtypes and
// shapes) of each tag's last transfer (TransferLayouts): the receiver posts the payload receives of the layout it
// expects ahead of time, and the sender, which knows what the receiver expects, sends the payloads to those
// receives when the layout is the same. When it differs, the header says so, the receives posted ahead are retired
// with a byte each, and the payloads go to tags of their own, received once the header has arrived.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/MemoryFormat.h>
#include <c10/core/ScalarType.h>

#include "smp/comm/communicator.h"

namespace smp::comm {

// At most this many tensors in a transfer whose header describes them; a transfer of more (or of tensors of many
// dimensions) packs them into one payload, its layout sent as a message of its own.
constexpr int kMaxTensorsPerTransfer = 15;
// Tags of one transfer are [tag, tag + kTagsPerTransfer): the header, then the payloads of the layout the receiver
// expected, then those of a new layout.
constexpr int kTagsPerTransfer = 32;

// What a transfer's header says of the sender's place in the program, for the receiver to compare with its own
// (why: the engine's ProgramCall, engine/src/pipeline/program_call.h): which call it is in and a signature of the
// batch it was given, opaque numbers here. kUnchecked: not compared.
constexpr std::int64_t kUnchecked = -1;
struct TransferStamp {
  std::int64_t call = kUnchecked;
  std::int64_t batch = kUnchecked;
};

// IncomingTensors::wait's error when the sender's stamp is not this end's.
class TransferOutOfStep : public CommError {
 public:
  TransferOutOfStep(const std::string& what, TransferStamp sent, TransferStamp expected)
      : CommError(what), sent(sent), expected(expected) {}
  TransferStamp sent;
  TransferStamp expected;
};

struct TensorLayout {
  c10::ScalarType dtype;
  std::vector<std::int64_t> sizes;
  // channels_last (and its 3-d kind) travel as they are and arrive so: a stage after a cut runs the kernels of the
  // format its producer chose, as one process would (they arrived in the default one, 1e-4 apart after 3 steps).
  c10::MemoryFormat format = c10::MemoryFormat::Contiguous;
  bool operator==(const TensorLayout& other) const {
    return dtype == other.dtype && sizes == other.sizes && format == other.format;
  }
};
// The format a tensor of 4 or 5 dimensions travels in: channels_last (or its 3-d kind) where its strides say so, as
// PyTorch's suggest_memory_format reads them; Contiguous otherwise.
c10::MemoryFormat transferred_format(const at::Tensor& tensor);

// The layout of each (peer, tag)'s last transfer, as one end saw it. Both ends of a channel see the same transfers
// in the same order, so the sender's memory of what it sent is the receiver's of what it received.
class TransferLayouts {
 public:
  const std::vector<TensorLayout>* find(int peer, int tag) const;
  void remember(int peer, int tag, std::vector<TensorLayout> layout) { layouts_[{peer, tag}] = std::move(layout); }
  void forget(int peer, int tag) { layouts_.erase({peer, tag}); }

 private:
  std::map<std::pair<int, int>, std::vector<TensorLayout>> layouts_;
};

// Posts the header and every tensor; the tensors are kept alive by the returned Pending. `layouts` (may be null:
// nothing remembered, every transfer a new layout) is this end's memory of the channel's transfers; `stamp` goes in
// the header.
std::unique_ptr<Pending> send_tensors(Communicator& comm, const std::vector<at::Tensor>& tensors, int peer, int tag,
                                      const std::string& what, TransferLayouts* layouts = nullptr,
                                      TransferStamp stamp = {});

// Posts the header receive at construction, so it can be done ahead of the compute that needs the tensors.
// `layouts` as in send_tensors, on the receiving end (it must outlive this); a header whose stamp differs from
// `stamp` (in a field neither end left kUnchecked) makes wait() throw TransferOutOfStep.
class IncomingTensors {
 public:
  IncomingTensors(Communicator& comm, int peer, int tag, std::string what, TransferLayouts* layouts = nullptr,
                  TransferStamp stamp = {});
  // Posts the payload receives of the layout this tag had last time, if any, so that the sender's payloads go out
  // at once: buffers of those shapes exist from now on, so call it shortly before the transfer is due.
  void post_expected();
  // Waits for the header, receives the tensors, returns them. Call once.
  std::vector<at::Tensor> wait();

 private:
  std::vector<TensorLayout> read_layout(const std::int64_t* slot, std::int64_t slots, std::int64_t count) const;
  std::vector<at::Tensor> receive_packed(std::int64_t count, std::int64_t layout_slots, std::int64_t bytes);

  Communicator& comm_;
  int peer_;
  int tag_;
  std::string what_;
  TransferLayouts* layouts_;
  TransferStamp stamp_;
  at::Tensor header_;
  std::unique_ptr<Pending> header_receive_;
  std::vector<at::Tensor> expected_;  // posted ahead, in the layout remembered
  std::vector<std::unique_ptr<Pending>> expected_receives_;
  bool expected_posted_ = false;
};

}  // namespace smp::comm
