#pragma once
// A real text corpus for the examples: the fortune cookie files of Debian's `fortunes` package, as bytes.
// Batches are drawn from (seed, step) alone, so every rank, and every run, sees the same global batch.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace smp::examples {

constexpr const char* kDefaultCorpusDir = "/usr/share/games/fortunes";

class TextCorpus {
 public:
  // Reads every regular text file of `directory` (sorted by name; the strfile .dat indexes are skipped).
  // Throws std::runtime_error naming the directory when it is missing or holds too little text.
  static TextCorpus load(const std::string& directory, int64_t min_bytes);

  std::size_t size() const { return bytes_.size(); }
  int file_count() const { return file_count_; }

  // Inputs and next-byte targets, both [batch, length] int64: `batch` windows at offsets drawn from (seed, step).
  std::pair<at::Tensor, at::Tensor> batch(std::uint64_t seed, std::int64_t step, int64_t batch, int64_t length) const;

 private:
  std::vector<std::uint8_t> bytes_;
  int file_count_ = 0;
};

}  // namespace smp::examples
