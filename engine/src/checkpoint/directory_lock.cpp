#include "checkpoint/directory_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "smp/checkpoint_manifest.h"

namespace smp {

namespace {

std::string this_process() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return "pid " + std::to_string(::getpid()) + " on " + host;
}

}  // namespace

DirectoryLock::DirectoryLock(const std::string& root) {
  const std::string path = root + "/.smp-lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) return;  // the write probe before this said whether the directory can be written
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
    const std::string holder = this_process();
    if (::ftruncate(fd_, 0) == 0) {
      [[maybe_unused]] const auto written = ::pwrite(fd_, holder.data(), holder.size(), 0);
    }
    return;
  }
  const int error = errno;
  if (error != EWOULDBLOCK) {  // no flock here (some network filesystems): go on unlocked
    ::close(fd_);
    fd_ = -1;
    return;
  }
  char holder[300] = {};
  const auto read = ::pread(fd_, holder, sizeof(holder) - 1, 0);
  ::close(fd_);
  fd_ = -1;
  if (read > 0 && std::string(holder, static_cast<std::size_t>(read)) == this_process()) {
    throw CheckpointError("checkpoint_dir \"" + root + "\" is held by another Checkpointer of this job (this "
                          "process, " + this_process() + "): one Checkpointer a job saves there; end the first "
                          "(wait(), then let it go) before making another");
  }
  throw CheckpointError("checkpoint_dir \"" + root + "\" is in use by another job (" +
                        (read > 0 ? std::string(holder, static_cast<std::size_t>(read)) : std::string("its holder")) +
                        " saves there): its saves and pruning would delete each other's files; give each job a "
                        "checkpoint_dir of its own, or end the other first");
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing lets go of the lock
}

}  // namespace smp
