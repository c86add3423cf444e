#pragma once
// Errors about the model and its numbers (config, communication and checkpoint errors live with their layers).

#include <stdexcept>

namespace smp {

// The model failed on its data (e.g. shapes that do not fit), with the stage and modules where it happened.
class ModelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A step whose loss or gradients are NaN or infinite, when the config says to stop ("nonfinite": "stop").
class NonFiniteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The program was interrupted (Ctrl-C) while the engine ran its code (a Python module or loss): no layer wraps it
// into an error of its own, and Python gets KeyboardInterrupt back.
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace smp
