// Tensor parallelism's collectives, each paired with the one its gradient needs, as operators of the dispatcher
// (torch.ops.smp.tp_*): the one definition that C++ layers, Python's smp.tp and a torch.export capture all call. As
// operators they stay whole nodes in a captured graph (a capture merges copies to the shards, rank 0 profiles them
// alone under WithoutCollectives), and their autograd is this file's whichever language calls them.
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "smp/collectives.h"
#include "smp/config.h"
#include "smp/tp.h"

namespace smp::tp {

namespace {

// Groups travel through the operators as numbers (an operator's arguments are tensors and scalars): 0 is the
// process's tensor-parallel group of the moment, others the groups C++ layers were built with. Held weakly, so that
// a group still ends with the last layer or runtime holding it.
struct GroupRegistry {
  std::mutex mutex;
  std::weak_ptr<comm::Communicator> process_group;
  std::vector<std::weak_ptr<comm::Communicator>> groups;  // handle i + 1
};
GroupRegistry& registry() {
  static GroupRegistry* groups = new GroupRegistry;  // never destroyed: autograd threads may ask at exit
  return *groups;
}

Group group_of(int64_t handle) {
  auto& groups = registry();
  const std::lock_guard<std::mutex> lock(groups.mutex);
  if (handle == 0) return groups.process_group.lock();
  if (handle < 0 || handle > static_cast<int64_t>(groups.groups.size())) {
    throw ConfigError("tensor-parallel operation: group " + std::to_string(handle) + " was never registered");
  }
  Group group = groups.groups[static_cast<std::size_t>(handle - 1)].lock();
  if (!group) throw ConfigError("tensor-parallel operation: group " + std::to_string(handle) + " no longer exists");
  return group;
}

int64_t ranks_of(const Group& group) { return group ? group->size() : 1; }

// The group a kernel with data communicates over (handle 0 before any runtime made one has none).
Group required_group(int64_t handle) {
  Group group = group_of(handle);
  if (!group) throw ConfigError("tensor-parallel operation without a tensor-parallel group: call smp.init first");
  return group;
}

at::Tensor summed(const at::Tensor& tensor, const Group& group) {
  at::Tensor sum = tensor.contiguous().clone();
  if (without_collectives()) {
    if (group->size() > 1) count_skipped_collective(2 * static_cast<int64_t>(sum.nbytes()));
    return sum;
  }
  run_collective("TP_ALL_REDUCE", static_cast<int64_t>(sum.nbytes()), CollectiveCounter::all_reduced,
                 [&] { group->all_reduce_sum(sum); });
  // A copy, never the transport's tensor: Gloo's work object keeps what it reduced and is destroyed later on a Gloo
  // thread, and when it drops the last hold of a tensor that Python has seen, that thread needs the GIL (at
  // interpreter exit it died inside a destructor, aborting the process).
  return sum.clone();
}

// The shards along `dim` of every rank put together (all-gather), and the sum over ranks of `whole` split along
// `dim`, this rank's part (reduce-scatter); the transports work along dimension 0.
at::Tensor gathered_along(const at::Tensor& shard, int64_t dim, const Group& group) {
  dim = c10::maybe_wrap_dim(dim, shard.dim());
  if (without_collectives()) {
    at::Tensor whole = at::cat(std::vector<at::Tensor>(static_cast<std::size_t>(group->size()), shard), dim);
    if (group->size() > 1) count_skipped_collective(static_cast<int64_t>(whole.nbytes()));
    return whole;
  }
  const at::Tensor front = shard.movedim(dim, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] *= group->size();
  at::Tensor whole = at::empty(sizes, front.options());
  run_collective("TP_ALL_GATHER", static_cast<int64_t>(whole.nbytes()), CollectiveCounter::all_gathered,
                 [&] { group->all_gather(whole, front); });
  return whole.movedim(0, dim).clone(at::MemoryFormat::Contiguous);  // never the transport's (along dimension 0)
}

// A new tensor, never a view of `whole` (an operator's output may not alias its input, and a slice along an outer
// dimension is contiguous already).
at::Tensor own_slice(const at::Tensor& whole, int64_t dim, const Group& group) {
  const int64_t width = whole.size(dim) / group->size();
  return whole.narrow(dim, group->rank() * width, width).clone(at::MemoryFormat::Contiguous);
}

at::Tensor reduce_scattered_along(const at::Tensor& whole, int64_t dim, const Group& group) {
  dim = c10::maybe_wrap_dim(dim, whole.dim());
  if (without_collectives()) {
    if (group->size() > 1) count_skipped_collective(static_cast<int64_t>(whole.nbytes()));
    return own_slice(whole, dim, group);
  }
  const at::Tensor front = whole.movedim(dim, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] /= group->size();
  at::Tensor shard = at::empty(sizes, front.options());
  run_collective("TP_REDUCE_SCATTER", static_cast<int64_t>(front.nbytes()), CollectiveCounter::reduce_scattered,
                 [&] { group->reduce_scatter_sum(shard, front); });
  return shard.movedim(0, dim).clone(at::MemoryFormat::Contiguous);
}

constexpr int64_t kLastDim = -1;

// The output's size along the pairing's dimension against the input's.
enum class Extent { same, times_ranks, over_ranks };

// A collective's forward, computed on this rank.
using Transform = at::Tensor (*)(const at::Tensor&, const Group&);

at::Tensor copied(const at::Tensor& tensor, const Group&) { return tensor.clone(); }  // an operator's output is new
at::Tensor passed_on(const at::Tensor& tensor, const Group&) { return tensor; }
at::Tensor gathered_last(const at::Tensor& shard, const Group& group) { return gathered_along(shard, kLastDim, group); }
at::Tensor own_last(const at::Tensor& whole, const Group& group) { return own_slice(whole, whole.dim() - 1, group); }
at::Tensor gathered_sequence(const at::Tensor& slice, const Group& group) {
  return gathered_along(slice, kSequenceDim, group);
}
at::Tensor own_sequence(const at::Tensor& whole, const Group& group) { return own_slice(whole, kSequenceDim, group); }
at::Tensor reduce_scattered_sequence(const at::Tensor& whole, const Group& group) {
  return reduce_scattered_along(whole, kSequenceDim, group);
}

// The pairings: one operator each, with its forward, the transform its gradient takes, and its output's extent.
// clang-format off
#define SMP_TP_PAIRINGS(PAIRING)                                                                              \
  PAIRING(copy_to_shards,               copied,                    summed,                    same,        0) \
  PAIRING(reduce_from_shards,           summed,                    passed_on,                 same,        0) \
  PAIRING(gather_last_dim,              gathered_last,             own_last,                  times_ranks, kLastDim) \
  PAIRING(scatter_last_dim,             own_last,                  gathered_last,             over_ranks,  kLastDim) \
  PAIRING(scatter_sequence,             own_sequence,              gathered_sequence,         over_ranks,  kSequenceDim) \
  PAIRING(gather_sequence,              gathered_sequence,         reduce_scattered_sequence, times_ranks, kSequenceDim) \
  PAIRING(gather_sequence_for_whole,    gathered_sequence,         own_sequence,              times_ranks, kSequenceDim) \
  PAIRING(reduce_scatter_sequence,      reduce_scattered_sequence, gathered_sequence,         over_ranks,  kSequenceDim)
// clang-format on

template <Transform Forward, Transform Backward, Extent kExtent, int64_t kDim>
struct Pairing {
  // On tensors with data, below autograd.
  static at::Tensor compute(const at::Tensor& input, int64_t handle) { return Forward(input, required_group(handle)); }

  // The output's shape only (torch.export's fake tensors), symbolic sizes included.
  static at::Tensor shape(const at::Tensor& input, int64_t handle) {
    std::vector<c10::SymInt> sizes = input.sym_sizes().vec();
    if (kExtent != Extent::same) {
      const int64_t ranks = ranks_of(group_of(handle));
      auto& size = sizes[static_cast<std::size_t>(c10::maybe_wrap_dim(kDim, input.dim()))];
      size = kExtent == Extent::times_ranks ? size * ranks : size / ranks;
    }
    return at::empty_symint(sizes, input.options());
  }

  struct Function : torch::autograd::Function<Function> {
    static at::Tensor forward(torch::autograd::AutogradContext* context, const at::Tensor& input, int64_t handle,
                              const c10::OperatorHandle* op) {
      context->saved_data["group"] = handle;
      // The operator again below autograd: its data kernel, or under a capture's fake tensors its shape kernel.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      return op->typed<at::Tensor(const at::Tensor&, int64_t)>().call(input, handle);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                   torch::autograd::variable_list gradients) {
      return {Backward(gradients[0], required_group(context->saved_data["group"].toInt())), at::Tensor(), at::Tensor()};
    }
  };
};

// Looked up once per name (the callers keep it); valid while the library is registered.
c10::OperatorHandle operator_named(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

#define SMP_TP_PAIRING_TYPE(name, forward, backward, extent, dim) \
  using name##_pairing = Pairing<forward, backward, Extent::extent, dim>;
SMP_TP_PAIRINGS(SMP_TP_PAIRING_TYPE)

#define SMP_TP_AUTOGRAD_KERNEL(name, forward, backward, extent, dim)                              \
  at::Tensor name##_with_autograd(const at::Tensor& input, int64_t handle) {                      \
    static const c10::OperatorHandle op = operator_named("smp::tp_" #name);                      \
    return name##_pairing::Function::apply(input, handle, &op);                                    \
  }
SMP_TP_PAIRINGS(SMP_TP_AUTOGRAD_KERNEL)

at::Tensor call(const c10::OperatorHandle& op, const at::Tensor& input, int64_t handle) {
  return op.typed<at::Tensor(const at::Tensor&, int64_t)>().call(input, handle);
}

// The sequence's length must divide by the group: each rank holds an equal slice. (A symbolic length, in a capture,
// is guarded as Python's `%` would.)
void check_sequence(const at::Tensor& input, const Group& group) {
  if (input.dim() < 2 || input.sym_size(kSequenceDim) % group->size() != 0) {
    // A capture's symbolic length is said by the size it stands for (the sample's), not its symbol's name.
    const std::string length =
        input.dim() < 2 ? "no" : std::to_string(input.sym_size(kSequenceDim).guard_int(__FILE__, __LINE__));
    throw ConfigError("sequence parallelism: a sequence of " + length +
                      " positions does not split over \"tensor_parallel_degree\" " + std::to_string(group->size()) +
                      " (its length must divide by it: pad the batch to a multiple of it)");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(smp, library) {
#define SMP_TP_DEFINE(name, forward, backward, extent, dim) \
  library.def("tp_" #name "(Tensor input, int group=0) -> Tensor");
  SMP_TP_PAIRINGS(SMP_TP_DEFINE)
}
TORCH_LIBRARY_IMPL(smp, CompositeExplicitAutograd, library) {
#define SMP_TP_COMPUTE(name, forward, backward, extent, dim) \
  library.impl("tp_" #name, TORCH_FN(name##_pairing::compute));
  SMP_TP_PAIRINGS(SMP_TP_COMPUTE)
}
TORCH_LIBRARY_IMPL(smp, Meta, library) {
#define SMP_TP_SHAPE(name, forward, backward, extent, dim) \
  library.impl("tp_" #name, TORCH_FN(name##_pairing::shape));
  SMP_TP_PAIRINGS(SMP_TP_SHAPE)
}
TORCH_LIBRARY_IMPL(smp, Autograd, library) {
#define SMP_TP_AUTOGRAD(name, forward, backward, extent, dim) \
  library.impl("tp_" #name, TORCH_FN(name##_with_autograd));
  SMP_TP_PAIRINGS(SMP_TP_AUTOGRAD)
}

void use_as_process_group(const Group& group) {
  auto& groups = registry();
  const std::lock_guard<std::mutex> lock(groups.mutex);
  groups.process_group = group;
}

Group process_group() { return group_of(0); }

namespace {

class StandInGroup final : public comm::Communicator {
 public:
  explicit StandInGroup(int degree) : degree_(degree), name_("profiled degree " + std::to_string(degree)) {}
  const std::string& name() const override { return name_; }
  int rank() const override { return 0; }
  int size() const override { return degree_; }
  int global_rank(int group_rank) const override { return group_rank; }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(0); }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::unique_ptr<comm::Pending> isend(const at::Tensor&, int, int) override { refuse(); }
  std::unique_ptr<comm::Pending> irecv(const at::Tensor&, int, int) override { refuse(); }
  std::unique_ptr<comm::Pending> iall_reduce_sum(const at::Tensor&) override { refuse(); }
  void broadcast(const at::Tensor&, int) override { refuse(); }
  void barrier() override { refuse(); }
  void all_gather(const at::Tensor&, const at::Tensor&) override { refuse(); }
  void reduce_scatter_sum(const at::Tensor&, const at::Tensor&) override { refuse(); }
  void all_to_all(const at::Tensor&, const at::Tensor&, const std::vector<std::int64_t>&,
                  const std::vector<std::int64_t>&) override {
    refuse();
  }

 private:
  [[noreturn]] void refuse() const {
    throw ConfigError("tensor-parallel group of " + name_ +
                      ": a stand-in for profiling moves nothing (its collectives run under WithoutCollectives)");
  }
  int degree_;
  std::string name_;
};

}  // namespace

ProfiledDegree::ProfiledDegree(int degree) : before_(process_group()), stand_in_(std::make_shared<StandInGroup>(degree)) {
  if (degree < 1) throw ConfigError("a tensor-parallel degree must be at least 1, got " + std::to_string(degree));
  use_as_process_group(stand_in_);
}

ProfiledDegree::~ProfiledDegree() { use_as_process_group(before_); }

int64_t group_handle(const Group& group) {
  auto& groups = registry();
  const std::lock_guard<std::mutex> lock(groups.mutex);
  // The process's group as 0, so that a captured graph follows the runtime's group of the moment.
  if (!group || groups.process_group.lock() == group) return 0;
  for (std::size_t i = 0; i < groups.groups.size(); ++i) {
    if (groups.groups[i].lock() == group) return static_cast<int64_t>(i) + 1;
  }
  for (std::size_t i = 0; i < groups.groups.size(); ++i) {  // a slot whose group has ended
    if (groups.groups[i].expired()) {
      groups.groups[i] = group;
      return static_cast<int64_t>(i) + 1;
    }
  }
  groups.groups.push_back(group);
  return static_cast<int64_t>(groups.groups.size());
}

#define SMP_TP_FUNCTION(name, forward, backward, extent, dim)                    \
  at::Tensor name(const at::Tensor& input, const Group& group) {                \
    if (ranks_of(group) == 1) return input;                                     \
    static const c10::OperatorHandle op = operator_named("smp::tp_" #name);    \
    return call(op, input, group_handle(group));                                \
  }
SMP_TP_FUNCTION(copy_to_shards, , , , )
SMP_TP_FUNCTION(reduce_from_shards, , , , )
SMP_TP_FUNCTION(gather_last_dim, , , , )
SMP_TP_FUNCTION(scatter_last_dim, , , , )

at::Tensor scatter_sequence(const at::Tensor& input, const Group& group) {
  if (ranks_of(group) == 1) return input;
  check_sequence(input, group);
  static const c10::OperatorHandle op = operator_named("smp::tp_scatter_sequence");
  return call(op, input, group_handle(group));
}

at::Tensor gather_sequence(const at::Tensor& input, const Group& group, bool for_whole) {
  if (ranks_of(group) == 1) return input;
  static const c10::OperatorHandle op = operator_named("smp::tp_gather_sequence");
  static const c10::OperatorHandle for_whole_op = operator_named("smp::tp_gather_sequence_for_whole");
  return call(for_whole ? for_whole_op : op, input, group_handle(group));
}

at::Tensor reduce_scatter_sequence(const at::Tensor& input, const Group& group) {
  if (ranks_of(group) == 1) return input;
  check_sequence(input, group);
  static const c10::OperatorHandle op = operator_named("smp::tp_reduce_scatter_sequence");
  return call(op, input, group_handle(group));
}

}  // namespace smp::tp
