#pragma once
// Modules whose training flags live outside LibTorch's (an eager Python module's, each of its submodules its own):
// evaluation puts them in eval mode and back through this, so that a submodule the program froze with .eval()
// stays frozen after, which LibTorch's recursive train(bool) over the wrapper's own flags would undo.

#include <functional>

namespace smp {

class ExternalModes {
 public:
  virtual ~ExternalModes() = default;
  // Every module of the tree in eval mode; returns what gives each its own mode back.
  virtual std::function<void()> enter_eval() = 0;
};

}  // namespace smp
