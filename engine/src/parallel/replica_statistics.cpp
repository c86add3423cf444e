// One operator of the dispatcher, smp::replica_sum, so that a torch.export capture keeps it as a whole node (its
// shape kernel serves the capture's fake tensors). No autograd of its own: the operation that pools statistics
// states its own gradient (a batch norm's pools two sums of the output's gradient, with this operator again).
#include "smp/replica_statistics.h"

#include <mutex>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "smp/collectives.h"

namespace smp {

namespace {

std::mutex group_mutex;
std::weak_ptr<comm::Communicator> current_group;  // under group_mutex

at::Tensor summed_over_replicas(const at::Tensor& input) {
  at::Tensor sum = input.contiguous().clone();
  const auto group = replica_group();
  if (!group || group->size() == 1 || without_collectives()) return sum;
  run_collective("REPLICA_ALL_REDUCE", static_cast<int64_t>(sum.nbytes()), CollectiveCounter::all_reduced,
                 [&] { group->all_reduce_sum(sum); });
  // Never the transport's tensor: Gloo's work object keeps it and drops it later on its own thread.
  return sum.clone();
}

at::Tensor shape_of(const at::Tensor& input) { return at::empty_symint(input.sym_sizes(), input.options()); }

const c10::OperatorHandle& replica_sum_operator() {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("smp::replica_sum", "");
  return op;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(smp, library) { library.def("replica_sum(Tensor input) -> Tensor"); }
TORCH_LIBRARY_IMPL(smp, CompositeExplicitAutograd, library) {
  library.impl("replica_sum", TORCH_FN(summed_over_replicas));
}
TORCH_LIBRARY_IMPL(smp, Meta, library) { library.impl("replica_sum", TORCH_FN(shape_of)); }

at::Tensor replica_sum(const at::Tensor& input) {
  return replica_sum_operator().typed<at::Tensor(const at::Tensor&)>().call(input);
}

void use_as_replica_group(const std::shared_ptr<comm::Communicator>& group) {
  const std::lock_guard<std::mutex> lock(group_mutex);
  current_group = group;
}

std::shared_ptr<comm::Communicator> replica_group() {
  const std::lock_guard<std::mutex> lock(group_mutex);
  return current_group.lock();
}

}  // namespace smp
