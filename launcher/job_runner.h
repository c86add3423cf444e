#pragma once

#include "command_line.h"

namespace smp::launch {

// Starts options.world_size ranks (options.master_port must already be chosen), forwards their output,
// stops them all when one fails, on --timeout or when smprun gets SIGINT/SIGTERM/SIGHUP, and returns
// smprun's exit code (see command_line.h). Installs process-wide signal handlers: call it once, from main.
int run_job(const LaunchOptions& options);

}  // namespace smp::launch
