#include <cstdlib>
#include <sstream>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "smp/comm/communicator.h"

namespace smp::comm {

std::string brief_message(const std::exception& error) {
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&error)) {
    std::string text = torch_error->what_without_backtrace();
    const auto newline = text.find('\n');
    return newline == std::string::npos ? text : text.substr(0, newline);
  }
  std::string text = error.what();
  const auto newline = text.find('\n');
  return newline == std::string::npos ? text : text.substr(0, newline);
}

namespace {

class GlooPending final : public Pending {
 public:
  GlooPending(c10::intrusive_ptr<c10d::Work> work, at::Tensor keep_alive, std::chrono::milliseconds timeout,
              std::string what)
      : work_(std::move(work)), keep_alive_(std::move(keep_alive)), timeout_(timeout), what_(std::move(what)) {}

  void wait() override {
    if (!work_) return;
    try {
      work_->wait(timeout_);
    } catch (const std::exception& error) {
      throw CommError(what_ + " failed: " + brief_message(error));
    }
    work_.reset();
    keep_alive_.reset();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor keep_alive_;
  std::chrono::milliseconds timeout_;
  std::string what_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, std::vector<int> members, int global_rank,
                   std::string name, const std::string& bind_host, std::chrono::milliseconds timeout)
      : members_(std::move(members)), name_(std::move(name)), timeout_(timeout) {
    for (std::size_t i = 0; i < members_.size(); ++i) {
      if (members_[i] == global_rank) rank_ = static_cast<int>(i);
    }
    if (rank_ < 0) throw CommError("rank " + std::to_string(global_rank) + " is not a member of group " + name_);
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
      throw CommError("creating communication group " + name_ + " failed: " + brief_message(error));
    }
  }

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  int global_rank(int group_rank) const override { return members_.at(group_rank); }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<Pending> isend(const at::Tensor& tensor, int peer, int tag) override {
    std::vector<at::Tensor> tensors{tensor};
    return post([&] { return group_->send(tensors, peer, tag); }, tensor,
                "sending to rank " + std::to_string(global_rank(peer)));
  }

  std::unique_ptr<Pending> irecv(const at::Tensor& into, int peer, int tag) override {
    std::vector<at::Tensor> tensors{into};
    return post([&] { return group_->recv(tensors, peer, tag); }, into,
                "receiving from rank " + std::to_string(global_rank(peer)));
  }

  void all_reduce_sum(const at::Tensor& tensor) override {
    std::vector<at::Tensor> tensors{tensor};
    post([&] { return group_->allreduce(tensors); }, tensor, "all-reduce in group " + name_)->wait();
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    post([&] { return group_->broadcast(tensors, options); }, tensor,
         "broadcast from rank " + std::to_string(global_rank(root)))
        ->wait();
  }

  void barrier() override {
    post([&] { return group_->barrier(); }, at::Tensor(), "barrier in group " + name_)->wait();
  }

 private:
  template <typename Start>
  std::unique_ptr<Pending> post(Start start, const at::Tensor& keep_alive, std::string what) {
    try {
      return std::make_unique<GlooPending>(start(), keep_alive, timeout_, std::move(what));
    } catch (const std::exception& error) {
      throw CommError(what + " failed: " + brief_message(error));
    }
  }

  std::vector<int> members_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  int rank_ = -1;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

}  // namespace

std::shared_ptr<Communicator> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              const std::vector<int>& members, int global_rank,
                                              const std::string& name, const std::string& bind_host,
                                              std::chrono::milliseconds timeout) {
  return std::make_shared<GlooCommunicator>(store, members, global_rank, name, bind_host, timeout);
}

}  // namespace smp::comm
