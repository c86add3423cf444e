#pragma once
// Logging front end. spdlog (Debian's, built on fmt 9) lives behind this header in one translation unit, because
// the torch wheel ships its own fmt 12 headers and the two must never meet in one file.

#include <string>

namespace smp::log {

void configure(int rank, const std::string& level);  // level: trace, debug, info, warn, error, off
bool enabled(const std::string& level);
void debug(const std::string& message);
void info(const std::string& message);
void warn(const std::string& message);
void error(const std::string& message);

}  // namespace smp::log
