#include "smp/comm/laned_communicator.h"

namespace smp::comm {
namespace {

thread_local bool second_lane = false;

class LanedCommunicator final : public Communicator {
 public:
  LanedCommunicator(std::shared_ptr<Communicator> first, std::shared_ptr<Communicator> second)
      : first_(std::move(first)), second_(std::move(second)) {
    if (first_->size() != second_->size() || first_->rank() != second_->rank()) {
      throw CommError("the lanes of " + first_->name() + " differ in their members");
    }
  }

  const std::string& name() const override { return first_->name(); }
  int rank() const override { return first_->rank(); }
  int size() const override { return first_->size(); }
  int global_rank(int group_rank) const override { return first_->global_rank(group_rank); }
  std::chrono::milliseconds timeout() const override { return first_->timeout(); }
  c10::Device device() const override { return first_->device(); }
  bool in_order() const override { return first_->in_order(); }
  void connect(const std::vector<std::pair<int, int>>& channels) override { lane().connect(channels); }
  void synchronize() override {
    first_->synchronize();
    second_->synchronize();
  }
  void leave(const std::string& reason) override {
    first_->leave(reason);
    second_->leave(reason);
  }
  std::unique_ptr<Pending> isend(const at::Tensor& tensor, int peer, int tag) override {
    return lane().isend(tensor, peer, tag);
  }
  std::unique_ptr<Pending> irecv(const at::Tensor& into, int peer, int tag) override {
    return lane().irecv(into, peer, tag);
  }
  std::unique_ptr<Pending> iall_reduce_sum(const at::Tensor& tensor) override { return lane().iall_reduce_sum(tensor); }
  void all_reduce_sum(const at::Tensor& tensor) override { lane().all_reduce_sum(tensor); }
  void broadcast(const at::Tensor& tensor, int root) override { lane().broadcast(tensor, root); }
  void barrier() override { lane().barrier(); }
  void all_gather(const at::Tensor& whole, const at::Tensor& shard) override { lane().all_gather(whole, shard); }
  void reduce_scatter_sum(const at::Tensor& shard, const at::Tensor& whole) override {
    lane().reduce_scatter_sum(shard, whole);
  }
  void all_to_all(const at::Tensor& output, const at::Tensor& input, const std::vector<std::int64_t>& output_rows,
                  const std::vector<std::int64_t>& input_rows) override {
    lane().all_to_all(output, input, output_rows, input_rows);
  }

 private:
  Communicator& lane() const { return second_lane ? *second_ : *first_; }

  std::shared_ptr<Communicator> first_;
  std::shared_ptr<Communicator> second_;
};

}  // namespace

SecondLane::SecondLane() : before_(second_lane) { second_lane = true; }
SecondLane::~SecondLane() { second_lane = before_; }
bool on_second_lane() { return second_lane; }

std::shared_ptr<Communicator> make_laned(std::shared_ptr<Communicator> first, std::shared_ptr<Communicator> second) {
  return std::make_shared<LanedCommunicator>(std::move(first), std::move(second));
}

}  // namespace smp::comm
