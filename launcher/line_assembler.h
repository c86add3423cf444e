#pragma once
// Turns the arbitrary chunks read from a rank's pipe back into whole lines, so that lines from different
// ranks are never cut into each other on smprun's output.

#include <cstddef>
#include <string>
#include <string_view>

namespace smp::launch {

class LineAssembler {
 public:
  // A rank writing megabytes without a newline (a progress bar, binary data) must not grow smprun without
  // bound: once this much is pending it is emitted as if it were a line.
  static constexpr std::size_t kDefaultMaxPendingBytes = std::size_t{1} << 20;

  explicit LineAssembler(std::size_t max_pending_bytes = kDefaultMaxPendingBytes)
      : max_pending_bytes_(max_pending_bytes) {}

  // Appends `chunk` and hands every completed line, without its '\n', to `on_line`.
  template <typename OnLine>
  void feed(std::string_view chunk, OnLine&& on_line) {
    pending_.append(chunk);
    std::size_t line_start = 0;
    for (std::size_t newline; (newline = pending_.find('\n', line_start)) != std::string::npos;
         line_start = newline + 1) {
      on_line(std::string_view(pending_).substr(line_start, newline - line_start));
    }
    pending_.erase(0, line_start);
    while (pending_.size() >= max_pending_bytes_) {
      on_line(std::string_view(pending_).substr(0, max_pending_bytes_));
      pending_.erase(0, max_pending_bytes_);
    }
  }

  // Hands a last line that had no '\n' to `on_line`, if there is one.
  template <typename OnLine>
  void flush(OnLine&& on_line) {
    if (pending_.empty()) return;
    on_line(std::string_view(pending_));
    pending_.clear();
  }

 private:
  std::size_t max_pending_bytes_;
  std::string pending_;
};

}  // namespace smp::launch
