#pragma once
// Ranks that fail alike (a config error every rank reads the same way) print the same Python traceback: eight
// ranks, eight copies of one error between the lines a user is looking for. The first copy goes out whole; a later
// rank's identical one goes out as two lines, naming the rank whose copy is above, and keeping the exception's own
// line so that the error is still there to read and grep on every rank.

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace smp::launch {

class TracebackFolder {
 public:
  // What one output stream of one rank holds back: a traceback until its exception line says how it ends.
  struct Held {
    std::vector<std::string> lines;
    std::size_t bytes = 0;
  };

  static constexpr std::string_view kStart = "Traceback (most recent call last):";
  // A traceback longer than this (deep recursion) goes out as it comes rather than held.
  static constexpr std::size_t kMaxHeldBytes = std::size_t{256} << 10;
  static constexpr std::size_t kMaxRemembered = 64;

  // Hands `line` of rank `rank` to `emit`, or holds it while it is part of a traceback; at the traceback's last
  // line, emits the traceback, or what stands for it when another rank printed the same.
  template <typename Emit>
  void line(Held& held, int rank, std::string_view line, Emit&& emit) {
    if (held.lines.empty()) {
      if (line == kStart) hold(held, line);
      else emit(line);
      return;
    }
    if (!line.empty() && (line.front() == ' ' || line.front() == '\t')) {  // a frame: Python indents them
      hold(held, line);
      if (held.bytes > kMaxHeldBytes) release(held, emit);
      return;
    }
    hold(held, line);  // the exception's line ends the traceback
    std::string text;
    for (const std::string& held_line : held.lines) text.append(held_line).push_back('\n');
    const auto printed = printed_.find(text);
    if (printed != printed_.end() && printed->second != rank) {
      const std::string stands_for =
          std::string(kStart) + " the same as rank " + std::to_string(printed->second) + "'s above";
      emit(std::string_view(stands_for));
      emit(std::string_view(held.lines.back()));
      held = Held{};
      return;
    }
    if (printed_.size() < kMaxRemembered) printed_.emplace(std::move(text), rank);
    release(held, emit);
  }

  // The stream ended inside a traceback (the rank died writing it): what was held goes out as it was.
  template <typename Emit>
  void flush(Held& held, Emit&& emit) {
    release(held, emit);
  }

 private:
  static void hold(Held& held, std::string_view line) {
    held.lines.emplace_back(line);
    held.bytes += line.size() + 1;
  }

  template <typename Emit>
  static void release(Held& held, Emit&& emit) {
    for (const std::string& held_line : held.lines) emit(std::string_view(held_line));
    held = Held{};
  }

  std::map<std::string, int> printed_;  // a traceback's text -> the rank that printed it whole
};

}  // namespace smp::launch
