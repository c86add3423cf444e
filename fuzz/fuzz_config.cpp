// Config::from_json_text reads a file the user wrote, before any communication: whatever the bytes, it must
// return a Config or throw ConfigError, so that smprun can print one line instead of crashing every rank.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <typeinfo>

#include <nlohmann/json.hpp>

#include "smp/config.h"

namespace {

[[noreturn]] void unexpected(const char* where, const std::exception* error) {
  std::fprintf(stderr, "%s threw %s: %s\n", where, error ? typeid(*error).name() : "a non-std exception",
               error ? error->what() : "");
  std::abort();  // libFuzzer saves the input on abort
}

void use_config(const smp::Config& config) {
  // World sizes around the interesting edges: none, one process, exactly the pipeline, replicas, a mismatch.
  const int worlds[] = {0, 1, 2, 3, config.partitions, 2 * config.partitions, 8 * config.partitions + 1};
  for (const int world : worlds) {
    try {
      const int replicas = config.replicas_for_world(world);
      if (replicas < 1 || static_cast<long long>(replicas) * config.partitions != world) std::abort();
    } catch (const smp::ConfigError&) {
    }
  }
  // Sections that may be absent, may be "smp" itself, or may be keys the fuzzer invents.
  for (const char* name : {"model", "smp", "", "partitions"}) {
    const nlohmann::json& section = config.application(name);
    if (!section.is_null() && section.dump().empty()) std::abort();
  }
  if (config.describe().empty() || config.schedule_name().empty() || config.num_stages() < 1) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    use_config(smp::Config::from_json_text(text, "fuzz.json"));
  } catch (const smp::ConfigError&) {
  } catch (const std::exception& error) {
    unexpected("Config", &error);
  } catch (...) {
    unexpected("Config", nullptr);
  }
  return 0;
}
