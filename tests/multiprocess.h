#pragma once
// What the multi-process tests share: running a bounded command, writing configs, reading worker output.

#include <catch2/catch.hpp>

#include <ftw.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "test_paths.h"

namespace smp_test {

namespace detail {

inline std::string& scratch_directory_path() {
  static std::string path;
  return path;
}

inline int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

// std::filesystem::remove_all is avoided: it has crashed in programs linked with LibTorch.
inline void remove_scratch_directory() {
  if (std::getenv("SMP_KEEP_TEST_FILES") == nullptr) ::nftw(scratch_directory_path().c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

}  // namespace detail

// One directory per test process for configs, checkpoints, logs and traces; it goes when the process exits
// (SMP_KEEP_TEST_FILES=1 keeps it for a look after a failure). Nothing is left behind in /tmp, and two test
// processes never share a file.
inline const std::string& scratch_directory() {
  std::string& path = detail::scratch_directory_path();
  if (path.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/smp_test_XXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
    std::atexit(detail::remove_scratch_directory);
  }
  return path;
}

inline std::string scratch_path(const std::string& name) { return scratch_directory() + "/" + name; }


struct Result {
  int status = -1;
  std::string output;
  double seconds = 0;
};

inline Result run_command(const std::string& command, int timeout_s) {
  // `timeout -k` also kills what ignores SIGTERM; a test can never hang past its bound.
  const std::string bounded = "OMP_NUM_THREADS=1 timeout -k 5 " + std::to_string(timeout_s) + " " + command + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  Result result;
  FILE* pipe = popen(bounded.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buffer{};
  while (std::fgets(buffer.data(), buffer.size(), pipe)) result.output += buffer.data();
  const int raw = pclose(pipe);
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

inline std::string write_config(const std::string& name, const std::string& json) {
  const std::string path = scratch_path(name + ".json");
  std::ofstream(path) << json;
  return path;
}

// The device is the CPU unless a test says otherwise: these stay CPU/Gloo tests on a GPU machine.
inline std::string smp_config(int pp, int dp, int microbatches, const std::string& pipeline, const std::string& placement,
                       int global_batch, double timeout_s = 60, const std::string& extra_keys = "",
                       const std::string& device = "cpu") {
  std::ostringstream json;
  json << R"({"partitions": )" << pp << R"(, "microbatches": )" << microbatches << R"(, "pipeline": ")" << pipeline
       << R"(", "ddp": )" << (dp > 1 ? "true" : "false") << R"(, "placement_strategy": ")" << placement
       << R"(", "global_batch_size": )" << global_batch << R"(, "seed": 5, "comm_timeout_s": )" << timeout_s
       << R"(, "device": ")" << device
       << "\"" << extra_keys << "}";
  return json.str();
}

// training_worker as the launcher starts it: through warm_rank, a fork of the warm worker, where the tests run beside
// one (SMP_WARM_WORKER, set by ctest; warm_worker/server.h).
inline std::string training_worker_command() {
  const char* warm = std::getenv("SMP_WARM_WORKER");
  if (warm == nullptr || *warm == '\0') return paths::training_worker;
  return std::string(paths::warm_rank) + " " + paths::training_worker;
}

// `launcher_flags` go to smprun (--grace 2: a stopped rank is killed 2 s after its peers failed).
inline Result run_worker(int processes, const std::string& config, const std::string& flags = "", int timeout_s = 240,
                         const std::string& launcher_flags = "") {
  return run_command(std::string(paths::smprun) + " " + launcher_flags + " -n " + std::to_string(processes) + " -- " +
                         training_worker_command() + " --config " + config + " " + flags,
                     timeout_s);
}

inline std::vector<double> step_losses(const std::string& output) {
  std::vector<double> losses;
  const std::regex line(R"(\[rank 0\] step \d+ loss ([0-9.eE+-]+))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
    losses.push_back(std::stod((*it)[1].str()));
  }
  return losses;
}

// Ranks whose every parameter matched single-process training (the worker's closing line).
inline int count_clean_ranks(const std::string& output) {
  const std::regex line(R"(rank \d+ stage \d+: \d+ parameters checked, 0 mismatches)");
  return static_cast<int>(std::distance(std::sregex_iterator(output.begin(), output.end(), line), std::sregex_iterator()));
}


// The job succeeded and every one of its `ranks` matched single-process training.
inline void check_clean_run(const Result& result, int ranks) {
  INFO(result.output);
  CHECK(result.status == 0);
  CHECK(count_clean_ranks(result.output) == ranks);
}

}  // namespace smp_test
