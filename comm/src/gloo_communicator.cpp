#include <algorithm>
#include <cctype>
#include <numeric>
#include <cstdlib>
#include <functional>
#include <sstream>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "smp/comm/communicator.h"
#include "smp/comm/sockets.h"
#include "socket_channels.h"

namespace smp::comm {

std::string brief_message(const std::exception& error) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
  std::string text = torch_error ? torch_error->what_without_backtrace() : error.what();
  // TorchScript's interpreter errors open with a traceback of the script; their last line holds the cause.
  if (text.rfind("The following operation failed in the TorchScript interpreter", 0) == 0) {
    const auto end = text.find_last_not_of("\n ");
    const auto start = text.rfind('\n', end);
    return text.substr(start == std::string::npos ? 0 : start + 1, end + 1 - (start == std::string::npos ? 0 : start + 1));
  }
  const auto newline = text.find('\n');
  if (newline != std::string::npos) text.resize(newline);
  // pybind11's text for a Python exception raised without a message (KeyboardInterrupt)
  const std::string empty = ": <EMPTY MESSAGE>";
  if (text.size() >= empty.size() && text.compare(text.size() - empty.size(), empty.size(), empty) == 0) {
    text.resize(text.size() - empty.size());
  }
  return text;
}

void check_shards(const at::Tensor& whole, const at::Tensor& shard, int members, const std::string& what) {
  const bool fits = whole.dim() >= 1 && whole.dim() == shard.dim() && whole.scalar_type() == shard.scalar_type() &&
                    whole.size(0) == shard.size(0) * members &&
                    std::equal(whole.sizes().begin() + 1, whole.sizes().end(), shard.sizes().begin() + 1);
  if (!fits) {
    throw CommError(what + ": the whole tensor " + c10::str(whole.sizes(), " ", whole.scalar_type()) + " is not " +
                    std::to_string(members) + " shards of " + c10::str(shard.sizes(), " ", shard.scalar_type()) +
                    " along dimension 0");
  }
}

void check_rows(const at::Tensor& output, const at::Tensor& input, const std::vector<std::int64_t>& output_rows,
                const std::vector<std::int64_t>& input_rows, int members, const std::string& what) {
  const auto total = [](const std::vector<std::int64_t>& rows) {
    return std::accumulate(rows.begin(), rows.end(), std::int64_t{0});
  };
  const auto none_negative = [](const std::vector<std::int64_t>& rows) {
    return std::all_of(rows.begin(), rows.end(), [](std::int64_t count) { return count >= 0; });
  };
  const bool counted = static_cast<int>(output_rows.size()) == members &&
                       static_cast<int>(input_rows.size()) == members && none_negative(output_rows) &&
                       none_negative(input_rows);
  const bool fits = counted && output.dim() >= 1 && output.dim() == input.dim() &&
                    output.scalar_type() == input.scalar_type() && total(output_rows) == output.size(0) &&
                    total(input_rows) == input.size(0) &&
                    std::equal(output.sizes().begin() + 1, output.sizes().end(), input.sizes().begin() + 1);
  if (!fits) {
    throw CommError(what + ": " + std::to_string(input_rows.size()) + " and " + std::to_string(output_rows.size()) +
                    " row counts for " + std::to_string(members) + " members do not describe the input " +
                    c10::str(input.sizes(), " ", input.scalar_type()) + " and the output " +
                    c10::str(output.sizes(), " ", output.scalar_type()));
  }
}

namespace {

class GlooPending final : public Pending {
 public:
  // `finish` runs after the work completes (copying a staged receive back to the device).
  // `absent`: who may have failed to come, as the timeout's message names them.
  GlooPending(c10::intrusive_ptr<c10d::Work> work, at::Tensor keep_alive, std::chrono::milliseconds timeout,
              std::string what, std::string absent, std::function<void()> finish = {})
      : work_(std::move(work)),
        keep_alive_(std::move(keep_alive)),
        timeout_(timeout),
        what_(std::move(what)),
        absent_(std::move(absent)),
        finish_(std::move(finish)) {}

  void wait() override {
    if (!work_) return;
    try {
      work_->wait(timeout_);
    } catch (const std::exception& error) {
      std::string reason = brief_message(error);
      std::string lower = reason;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
      // Gloo says only "Operation timed out!": a member that never came, or came to another collective.
      if (lower.find("timed out") != std::string::npos) {
        reason += " (after " + std::to_string(timeout_.count() / 1000) + " s, comm_timeout_s: " + absent_ +
                  " never joined; do all ranks run the same steps, in the same order?)";
      } else if (lower.find("connection reset") != std::string::npos ||
                 lower.find("connection closed") != std::string::npos ||
                 lower.find("broken pipe") != std::string::npos || lower.find("end of file") != std::string::npos) {
        // Gloo names the peer's socket address, not its rank.
        reason += " (" + absent_ + " closed its connection: it exited or failed, and its own error, or the " +
                  "launcher's, says why)";
      }
      throw CommError(what_ + " failed: " + reason);
    }
    work_.reset();
    if (finish_) finish_();
    finish_ = nullptr;
    keep_alive_.reset();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor keep_alive_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  std::string absent_;
  std::function<void()> finish_;
};

// A receive into host memory, copied to the device tensor it stands in for once complete.
class Staged final : public Pending {
 public:
  Staged(std::unique_ptr<Pending> receive, std::function<void()> finish)
      : receive_(std::move(receive)), finish_(std::move(finish)) {}
  void wait() override {
    if (!receive_) return;
    receive_->wait();
    receive_.reset();
    finish_();
  }

 private:
  std::unique_ptr<Pending> receive_;
  std::function<void()> finish_;
};

// Gloo moves host memory only: a tensor elsewhere (a GPU with "backend": "gloo") travels through a CPU copy.
// What the transfers and Gloo's worker threads hold: a shallow copy of a CPU tensor (the same memory, no autograd,
// no Python object). A tensor Python made, dropped last on such a thread after the interpreter began to exit (work a
// failed step left behind), would take the GIL there, and CPython ends a thread that does so by unwinding it through
// frames that cannot be unwound: std::terminate, the process killed by SIGABRT.
at::Tensor on_host(const at::Tensor& tensor) {
  return tensor.is_cpu() ? tensor.variable_data() : tensor.to(c10::kCPU);
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, std::vector<int> members, int global_rank,
                   std::string name, const std::string& bind_host, std::chrono::milliseconds timeout,
                   c10::Device device)
      : members_(std::move(members)),
        name_(std::move(name)),
        timeout_(timeout),
        device_(device),
        // For tests: payloads matched by order as NCCL matches them, so that CPU jobs cover that path too.
        in_order_(std::getenv("SMP_GLOO_IN_ORDER") && std::string(std::getenv("SMP_GLOO_IN_ORDER")) == "1") {
    for (std::size_t i = 0; i < members_.size(); ++i) {
      if (members_[i] == global_rank) rank_ = static_cast<int>(i);
    }
    if (rank_ < 0) throw CommError("rank " + std::to_string(global_rank) + " is not a member of group " + name_);
    // Point-to-point transfers between the channels connect() names go over connections of their own
    // (socket_channels.h); SMP_P2P=gloo keeps them on Gloo's send and receive, for comparisons.
    // Small all-reduces and barriers go over the same connections, along a binary tree of the group's ranks.
    const char* p2p = std::getenv("SMP_P2P");
    if (!p2p || std::string(p2p) != "gloo") {
      const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
      channels_ = std::make_unique<SocketChannels>(
          store, "smp/p2p/" + name_ + "/", rank_,
          interface ? address_of_interface(std::string(interface).substr(0, std::string(interface).find(',')))
                    : bind_host,
          timeout, [this](int peer) { return "rank " + std::to_string(members_.at(peer)); });
    }
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->timeout = timeout;
    // Two threads: collectives of one group are issued in program order, and the point-to-point path does not
    // use these threads at all.
    options->threads = 2;
    try {
      if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME")) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
      } else if (!bind_host.empty()) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_host));
      } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>(name_, store),
                                                           rank_, static_cast<int>(members_.size()), options);
    } catch (const std::exception& error) {
      const std::string why = brief_message(error);
      // Every group is made at start, the size-1 ones of unused axes too, through rank 0's store: when a rank fails
      // there first, the others fail in whichever group they were making, named after a feature the job may not use.
      const bool peer_gone = why.find("reset by peer") != std::string::npos ||
                             why.find("Failed to recv") != std::string::npos ||
                             why.find("Connection closed") != std::string::npos;
      throw CommError("creating communication group " + name_ + " failed: " + why +
                      (peer_gone ? " (the store or a member went away: most often another rank failed first, and "
                                   "its own error says why)"
                                 : ""));
    }
    if (channels_ && size() > 1) {
      std::vector<int> tree;
      if (rank_ > 0) tree.push_back(parent());
      for (int child : children()) tree.push_back(child);
      channels_->connect(tree);
    }
  }

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  int global_rank(int group_rank) const override { return members_.at(group_rank); }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  c10::Device device() const override { return device_; }
  bool in_order() const override { return in_order_; }

  void leave(const std::string& reason) override {
    if (channels_) channels_->leave(reason);
  }

  void connect(const std::vector<std::pair<int, int>>& channels) override {
    if (!channels_) return;
    std::vector<int> peers;
    for (const auto& [sender, receiver] : channels) {
      if (sender == rank_) peers.push_back(receiver);
      if (receiver == rank_) peers.push_back(sender);
    }
    std::sort(peers.begin(), peers.end());
    peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
    channels_->connect(peers);
  }

  std::unique_ptr<Pending> isend(const at::Tensor& tensor, int peer, int tag) override {
    if (channels_ && channels_->connected(peer)) {
      return channels_->isend(on_host(tensor).contiguous(), peer, tag,
                              "sending to rank " + std::to_string(global_rank(peer)));
    }
    std::vector<at::Tensor> tensors{on_host(tensor)};
    return post([&] { return group_->send(tensors, peer, tag); }, tensors[0],
                "sending to rank " + std::to_string(global_rank(peer)));
  }

  std::unique_ptr<Pending> irecv(const at::Tensor& into, int peer, int tag) override {
    if (channels_ && channels_->connected(peer)) {
      const at::Tensor staged = on_host(into);
      auto receive = channels_->irecv(staged, peer, tag, "receiving from rank " + std::to_string(global_rank(peer)));
      auto finish = copy_back(into, staged);
      if (!finish) return receive;
      return std::make_unique<Staged>(std::move(receive), std::move(finish));
    }
    std::vector<at::Tensor> tensors{on_host(into)};
    return post([&] { return group_->recv(tensors, peer, tag); }, tensors[0],
                "receiving from rank " + std::to_string(global_rank(peer)), copy_back(into, tensors[0]));
  }

  // Blocking: along the tree when small. Asynchronous ones (gradient buckets during backward) stay on Gloo, whose
  // threads progress them in the background whatever order the members wait for them in.
  void all_reduce_sum(const at::Tensor& tensor) override {
    if (over_tree(tensor)) {
      TreeAllReduce(*this, tensor, next_tree_tag()).wait();
      return;
    }
    iall_reduce_sum(tensor)->wait();
  }

  std::unique_ptr<Pending> iall_reduce_sum(const at::Tensor& tensor) override {
    std::vector<at::Tensor> tensors{on_host(tensor)};
    return post([&] { return group_->allreduce(tensors); }, tensors[0], "all-reduce in group " + name_,
                copy_back(tensor, tensors[0]));
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors{on_host(tensor)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    post([&] { return group_->broadcast(tensors, options); }, tensors[0],
         "broadcast from rank " + std::to_string(global_rank(root)), copy_back(tensor, tensors[0]))
        ->wait();
  }

  void all_gather(const at::Tensor& whole, const at::Tensor& shard) override {
    const std::string what = "all-gather in group " + name_;
    check_shards(whole, shard, size(), what);
    at::Tensor staged = on_host(whole);
    if (!staged.is_contiguous()) staged = staged.contiguous();
    const at::Tensor sent = on_host(shard).contiguous();
    post([&] { return group_->_allgather_base(staged, const_cast<at::Tensor&>(sent)); }, staged, what,
         copy_back(whole, staged))
        ->wait();
  }

  void reduce_scatter_sum(const at::Tensor& shard, const at::Tensor& whole) override {
    const std::string what = "reduce-scatter in group " + name_;
    check_shards(whole, shard, size(), what);
    at::Tensor staged = on_host(shard);
    if (!staged.is_contiguous()) staged = staged.contiguous();
    const at::Tensor sent = on_host(whole).contiguous();
    post([&] { return group_->_reduce_scatter_base(staged, const_cast<at::Tensor&>(sent)); }, staged, what,
         copy_back(shard, staged))
        ->wait();
  }

  void all_to_all(const at::Tensor& output, const at::Tensor& input, const std::vector<std::int64_t>& output_rows,
                  const std::vector<std::int64_t>& input_rows) override {
    const std::string what = "all-to-all in group " + name_;
    check_rows(output, input, output_rows, input_rows, size(), what);
    at::Tensor staged = on_host(output);
    if (!staged.is_contiguous()) staged = staged.contiguous();
    const at::Tensor sent = on_host(input).contiguous();
    std::vector<std::int64_t> received_rows = output_rows, sent_rows = input_rows;
    post([&] { return group_->alltoall_base(staged, const_cast<at::Tensor&>(sent), received_rows, sent_rows); },
         staged, what, copy_back(output, staged))
        ->wait();
  }

  void barrier() override {
    if (channels_ && size() > 1) {
      TreeAllReduce(*this, at::zeros({1}, at::kInt), next_tree_tag()).wait();
      return;
    }
    post([&] { return group_->barrier(); }, at::Tensor(), "barrier in group " + name_)->wait();
  }

  // An all-reduce of a small host tensor along a binary tree of group ranks over the channels: up to rank 0, summed
  // on the way, and the sum back down. Latency 2 log2(size) trips, where Gloo's costs a hop through its worker and
  // I/O threads on every rank for each of its own. The tags keep one collective's messages from another's.
  class TreeAllReduce final : public Pending {
   public:
    TreeAllReduce(GlooCommunicator& group, at::Tensor tensor, int tag)
        : group_(group), tensor_(std::move(tensor)), tag_(tag) {}
    void wait() override {
      if (done_) return;
      done_ = true;
      const at::Tensor host = on_host(tensor_);
      at::Tensor sum = host.is_contiguous() ? host : host.contiguous();
      SocketChannels& channels = *group_.channels_;
      const auto& name = group_.name_;
      for (int child : group_.children()) {
        const at::Tensor part = at::empty_like(sum);
        channels.irecv(part, child, tag_, "all-reduce in group " + name + ": receiving from " + group_.describe(child))->wait();
        sum.add_(part);
      }
      if (group_.rank_ > 0) {
        const int parent = group_.parent();
        channels.isend(sum, parent, tag_, "all-reduce in group " + name + ": sending to " + group_.describe(parent))->wait();
        channels.irecv(sum, parent, tag_ - 1, "all-reduce in group " + name + ": receiving from " + group_.describe(parent))
            ->wait();
      }
      std::vector<std::unique_ptr<Pending>> down;
      for (int child : group_.children()) {
        down.push_back(channels.isend(sum, child, tag_ - 1, "all-reduce in group " + name + ": sending to " +
                                                                 group_.describe(child)));
      }
      for (auto& send : down) send->wait();
      if (!sum.is_same(tensor_)) tensor_.copy_(sum);
    }

   private:
    GlooCommunicator& group_;
    at::Tensor tensor_;
    int tag_;
    bool done_ = false;
  };

 private:
  int parent() const { return (rank_ - 1) / 2; }
  std::vector<int> children() const {
    std::vector<int> found;
    for (int child : {2 * rank_ + 1, 2 * rank_ + 2}) {
      if (child < size()) found.push_back(child);
    }
    return found;
  }
  std::string describe(int peer) const { return "rank " + std::to_string(members_.at(peer)); }
  // Gloo's timeout does not say who stayed away; in a pair it can only be the other one.
  std::string who_may_be_absent() const {
    if (size() == 2) return describe(1 - rank_) + ", the group's other member,";
    std::string others;
    for (int member = 0; member < size(); ++member) {
      if (member != rank_) others += (others.empty() ? "" : ", ") + std::to_string(members_[member]);
    }
    return "one of the group's other members (ranks " + others + ")";
  }
  // Sums of a few values (a loss, a norm, flags): along the tree; large ones (gradient buckets) keep Gloo's ring.
  bool over_tree(const at::Tensor& tensor) const {
    constexpr std::size_t kTreeBytes = 64 << 10;
    return channels_ && size() > 1 && tensor.nbytes() <= kTreeBytes && !tensor.is_complex() &&
           tensor.scalar_type() != at::kBool;
  }
  // Negative, two per collective (up and down), never a point-to-point tag.
  int next_tree_tag() {
    tree_tags_ = (tree_tags_ + 2) % (1 << 29);
    return -1 - tree_tags_;
  }

  static std::function<void()> copy_back(const at::Tensor& target, const at::Tensor& staged) {
    const bool same_memory = target.is_same(staged) ||
                             (target.is_cpu() && target.data_ptr() == staged.data_ptr() &&
                              target.sizes() == staged.sizes() && target.strides() == staged.strides());
    if (same_memory) return {};
    return [target, staged]() mutable { target.copy_(staged); };
  }

  template <typename Start>
  std::unique_ptr<Pending> post(Start start, const at::Tensor& keep_alive, std::string what,
                                std::function<void()> finish = {}) {
    try {
      return std::make_unique<GlooPending>(start(), keep_alive, timeout_, std::move(what), who_may_be_absent(),
                                           std::move(finish));
    } catch (const std::exception& error) {
      throw CommError(what + " failed: " + brief_message(error));
    }
  }

  std::vector<int> members_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;
  bool in_order_;
  int rank_ = -1;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  std::unique_ptr<SocketChannels> channels_;
  int tree_tags_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              const std::vector<int>& members, int global_rank,
                                              const std::string& name, const std::string& bind_host,
                                              std::chrono::milliseconds timeout, c10::Device device) {
  return std::make_shared<GlooCommunicator>(store, members, global_rank, name, bind_host, timeout, device);
}

}  // namespace smp::comm
