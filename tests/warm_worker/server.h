#pragma once
// A warm worker: one process that has paid a LibTorch program's start-up (its libraries' loading and static
// initialization, about 0.3 s of CPU and most of a short test job's cost on 2 cores) and forks each rank from there,
// as the Python tests' warm pool does for their interpreters. A rank still runs as the program would: its own argv,
// environment, working directory, standard streams and exit status; a rank killed by a signal reports that signal.
// The launcher starts warm_rank in its place, which hands the request to the server named by SMP_WARM_WORKER, or
// runs the program itself where there is none (the same job either way).
//
//   PROGRAM --warm-start NAME   starts a server in the background (after stopping any of that name)
//   PROGRAM --warm-stop NAME    stops it
//   PROGRAM --warm-serve NAME   serves in the foreground

#include <functional>

namespace smp_test::warm {

// Runs one of the commands above when argv names one, else `main`; the fork of a served request runs `main` with
// the request's argv and exits with its status.
int main_or_serve(int argc, char** argv, const std::function<int(int, char**)>& main);

}  // namespace smp_test::warm
