#pragma once
// A copy of an optimizer's state to be serialized later, on the checkpoint writer's thread, while training goes on
// changing the live state in place: the save pauses the step for copying tensors, not for writing the archive.

#include <functional>
#include <map>
#include <optional>
#include <string>

namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class InputArchive;
}

namespace smp {

// Returns a function that produces, when called on any thread, the bytes optimizer.save() would have written at
// this moment (LibTorch's archive format, which Optimizer::load reads), with the state tensors on the CPU: load
// them with InputArchive::load_from(stream, device). Adam, AdamW, SGD and RMSprop state is copied tensor by
// tensor into a twin optimizer that only ever saves; any other optimizer is serialized right here.
// The archive also names the optimizer's class, and holds `program_state` (Checkpointer's ProgramState bytes, by
// name) when there is any.
std::function<std::string()> snapshot_optimizer(torch::optim::Optimizer& optimizer,
                                                std::map<std::string, std::string> program_state = {});

// The program state an archive holds; nullopt for one saved without it.
std::optional<std::map<std::string, std::string>> saved_program_state(torch::serialize::InputArchive& archive);

// Throws CheckpointError naming both classes when `archive` was saved by another optimizer class than `optimizer`'s;
// archives written before the class was recorded pass.
void check_saved_optimizer_class(torch::serialize::InputArchive& archive, const torch::optim::Optimizer& optimizer);

}  // namespace smp
