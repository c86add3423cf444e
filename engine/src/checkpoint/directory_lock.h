#pragma once
// One job at a time saves into a checkpoint directory. A second job's saves and pruning deleted the first's files
// under it (whose saves then failed with a bare "No such file or directory") and a resume could find either's.

#include <string>

namespace smp {

class DirectoryLock {
 public:
  // Holds an exclusive flock on `root`/.smp-lock while it lives (the kernel lets go when the process dies, however
  // it dies). CheckpointError naming the holder when another process holds it. A filesystem without flock gets no
  // lock, and says nothing.
  explicit DirectoryLock(const std::string& root);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace smp
