#pragma once
// Hugging Face's safetensors format, read and written without holding a whole model: a file is an 8-byte
// little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}, "__metadata__": {...}}) and the
// tensors' bytes; a model larger than one file is shards plus model.safetensors.index.json ({"weight_map": {name:
// shard}}). transformers' from_pretrained and save_pretrained use exactly this layout.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace smp {

// The tensors of a safetensors file, of a directory holding model.safetensors, or of a directory of shards with
// model.safetensors.index.json. Opening reads the headers only; read() reads one tensor's bytes. CheckpointError
// names the file on anything malformed.
class SafetensorsSource {
 public:
  explicit SafetensorsSource(const std::string& path);
  // True for a directory with model.safetensors or an index, or a file ending in ".safetensors".
  static bool is_safetensors(const std::string& path);

  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  std::vector<std::int64_t> shape(const std::string& name) const;
  const std::string& file_of(const std::string& name) const;
  at::Tensor read(const std::string& name) const;  // on the CPU, in the stored dtype
  std::vector<std::string> names() const;
  const std::string& description() const { return description_; }

 private:
  struct Entry {
    std::string file;
    at::ScalarType dtype;
    std::vector<std::int64_t> shape;
    std::uint64_t begin = 0, end = 0;  // absolute offsets in the file
  };
  void add_file(const std::string& file, const std::vector<std::string>* expected_names);
  std::string description_;
  std::map<std::string, Entry> entries_;
};

// Writes tensors as safetensors shards of at most `max_shard_bytes` each (a larger tensor gets a shard of its
// own), into `directory`: model.safetensors when one shard holds everything, else model-0000k-of-0000n.safetensors
// and model.safetensors.index.json. A shard is written once full, so the writer holds at most one shard's tensors.
// Files are written under temporary names and renamed by finish(), the index last; shards of an earlier export that
// the new one does not use are removed then.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string directory, std::int64_t max_shard_bytes);
  ~SafetensorsWriter();  // removes what an unfinished export wrote
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void add(const std::string& name, const at::Tensor& tensor);  // CheckpointError for a name given twice
  // Returns the files written, in order.
  std::vector<std::string> finish();

 private:
  void flush();
  std::string directory_;
  std::int64_t max_shard_bytes_;
  std::vector<std::pair<std::string, at::Tensor>> pending_;
  std::int64_t pending_bytes_ = 0;
  std::vector<std::string> shard_temporaries_;  // written, not yet renamed
  std::string index_temporary_;
  std::map<std::string, int> shard_of_;  // name -> shard index
  std::int64_t total_bytes_ = 0;
};

}  // namespace smp
