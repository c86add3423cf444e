#include "smp/log.h"

#include <memory>

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace smp::log {
namespace {

std::shared_ptr<spdlog::logger>& logger() {
  // stderr keeps stdout free for the step lines that users and scripts parse.
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto created = spdlog::stderr_logger_mt("smp");
    created->set_pattern("[smp %Y-%m-%d %H:%M:%S.%e] %^%l%$ %v");
    return created;
  }();
  return instance;
}

}  // namespace

void configure(int rank, const std::string& level) {
  logger()->set_pattern("[smp r" + std::to_string(rank) + " %H:%M:%S.%e] %^%l%$ %v");
  logger()->set_level(spdlog::level::from_str(level));
}

bool enabled(const std::string& level) { return logger()->should_log(spdlog::level::from_str(level)); }
void debug(const std::string& message) { logger()->debug(message); }
void info(const std::string& message) { logger()->info(message); }
void warn(const std::string& message) { logger()->warn(message); }
void error(const std::string& message) { logger()->error(message); }

}  // namespace smp::log
