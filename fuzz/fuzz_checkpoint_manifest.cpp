// The checkpoint reader decides whether a directory left by a possibly killed job is safe to resume from: a torn,
// truncated or hostile manifest must end in CheckpointError (so find_latest_checkpoint skips it), never in a
// crash or another exception type that would take the resuming job down.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <typeinfo>

#include "smp/checkpoint_manifest.h"

namespace {

// The partition files the seed manifests in fuzz/corpus/manifest describe (sizes and CRC-32s must match them).
constexpr const char* kPartition0 = "partition 0 of step 7";
constexpr const char* kPartition1 = "partition 1 of step 7";

[[noreturn]] void unexpected(const char* where, const std::exception* error) {
  std::fprintf(stderr, "%s threw %s: %s\n", where, error ? typeid(*error).name() : "a non-std exception",
               error ? error->what() : "");
  std::abort();  // libFuzzer saves the input on abort
}

void write(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(2);  // a broken harness, not a finding
  }
}

void remove_directory();

// Per process, so that parallel fuzzers (-jobs, several clones under ctest) do not race on the files. In memory
// when possible: rewriting manifest.json every run on a disk mounted with `discard` costs milliseconds per
// truncate. Never destroyed: a static string would be gone before the exit handler below that still needs it.
const std::string& directory() {
  static const std::string* const path = [] {
    const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    const auto made = new std::string(std::string(base) + "/smp_fuzz_checkpoint_" + std::to_string(getpid()));
    std::filesystem::create_directories(*made);
    write(*made + "/partition-0000.pt", kPartition0);
    write(*made + "/partition-0001.pt", kPartition1);
    std::atexit(remove_directory);
    return made;
  }();
  return *path;
}

void remove_directory() {
  std::error_code ignored;
  std::filesystem::remove_all(directory(), ignored);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  bool parsed = false;
  try {
    const auto manifest = smp::CheckpointManifest::parse(text, "manifest.json");
    parsed = true;
    // A manifest that parse accepts must survive to_json and parse unchanged, or a saved one could be unreadable.
    const auto again = smp::CheckpointManifest::parse(manifest.to_json(), "rewritten");
    if (again.to_json() != manifest.to_json()) {
      std::fprintf(stderr, "manifest changed on a round trip\n");
      std::abort();
    }
  } catch (const smp::CheckpointError& error) {
    if (parsed) unexpected("CheckpointManifest round trip", &error);
  } catch (const std::exception& error) {
    unexpected(parsed ? "CheckpointManifest round trip" : "CheckpointManifest::parse", &error);
  } catch (...) {
    unexpected("CheckpointManifest::parse", nullptr);
  }

  // verify_checkpoint parses the same text first, so a rejected manifest gains nothing from the files; skipping
  // it keeps runs cheap (reading each partition file allocates a 1 MiB buffer, slow under ASan).
  if (!parsed) return 0;
  const std::string& checkpoint = directory();
  write(checkpoint + "/manifest.json", text);
  try {
    smp::verify_checkpoint(checkpoint);
  } catch (const smp::CheckpointError&) {
  } catch (const std::exception& error) {
    unexpected("verify_checkpoint", &error);
  } catch (...) {
    unexpected("verify_checkpoint", nullptr);
  }
  return 0;
}
