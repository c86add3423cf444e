#include "text_corpus.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>

#include <ATen/ATen.h>

namespace smp::examples {

// When `directory` is kDefaultCorpusDir and the environment variable SMP_FORTUNES_DIR is set (non-empty), that
// directory is read instead: machines without the `fortunes` package installed (the GPU machine, where
// scripts/device_gpu.sh unpacks it under /tmp/smp-deps) point there. Any other directory is read as given.
TextCorpus TextCorpus::load(const std::string& directory, int64_t min_bytes) {
  namespace fs = std::filesystem;
  const char* override_dir = std::getenv("SMP_FORTUNES_DIR");
  const std::string dir =
      directory == kDefaultCorpusDir && override_dir != nullptr && *override_dir != '\0' ? override_dir : directory;
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    throw std::runtime_error("corpus directory " + dir +
                             " not found; install Debian's `fortunes` package (scripts/setup.sh does), "
                             "set SMP_FORTUNES_DIR, or pass --data DIR");
  }
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_symlink() || !entry.is_regular_file() || entry.path().extension() == ".dat") continue;
    files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  TextCorpus corpus;
  for (const auto& path : files) {
    std::ifstream in(path, std::ios::binary);
    corpus.bytes_.insert(corpus.bytes_.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    ++corpus.file_count_;
  }
  if (static_cast<int64_t>(corpus.bytes_.size()) < min_bytes) {
    throw std::runtime_error("corpus directory " + dir + " holds " + std::to_string(corpus.bytes_.size()) +
                             " bytes of text; at least " + std::to_string(min_bytes) + " are needed");
  }
  return corpus;
}

std::pair<at::Tensor, at::Tensor> TextCorpus::batch(std::uint64_t seed, std::int64_t step, int64_t batch,
                                                    int64_t length) const {
  // A generator of our own, not torch's: the data must not depend on how many random numbers the model used.
  std::seed_seq sequence{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                         static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32)};
  std::mt19937_64 generator(sequence);
  std::uniform_int_distribution<std::size_t> offset_of(0, bytes_.size() - static_cast<std::size_t>(length) - 1);
  at::Tensor inputs = at::empty({batch, length}, at::kLong);
  at::Tensor targets = at::empty({batch, length}, at::kLong);
  auto* input_data = inputs.data_ptr<int64_t>();
  auto* target_data = targets.data_ptr<int64_t>();
  for (int64_t row = 0; row < batch; ++row) {
    const std::size_t offset = offset_of(generator);
    for (int64_t column = 0; column < length; ++column) {
      input_data[row * length + column] = bytes_[offset + column];
      target_data[row * length + column] = bytes_[offset + column + 1];
    }
  }
  return {inputs, targets};
}

}  // namespace smp::examples
