#include "smp/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "smp/checkpoint_manifest.h"
#include "smp/timeline.h"

namespace smp {
namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
// The format's bound on the header, against a corrupt length reading gigabytes.
constexpr std::uint64_t kMaxHeaderBytes = 100 << 20;

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, at::ScalarType>> names = {
      {"F64", at::kDouble}, {"F32", at::kFloat},  {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool},  {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2}};
  return names;
}

std::string dtype_name(at::ScalarType type, const std::string& tensor) {
  for (const auto& [name, known] : dtype_names()) {
    if (known == type) return name;
  }
  throw CheckpointError("tensor '" + tensor + "' has dtype " + std::string(c10::toString(type)) +
                        ", which safetensors does not store");
}

// Reads exactly `size` bytes at `offset`, or throws naming the file.
void read_at(int fd, const std::string& file, void* into, std::uint64_t size, std::uint64_t offset) {
  auto* bytes = static_cast<char*>(into);
  std::uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, bytes + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CheckpointError(file + ": truncated or unreadable at byte " + std::to_string(offset + done));
    done += static_cast<std::uint64_t>(n);
  }
}

class File {
 public:
  File(const std::string& path, int flags) : fd_(::open(path.c_str(), flags | O_CLOEXEC, 0644)) {
    if (fd_ < 0) throw CheckpointError(path + ": cannot open: " + std::strerror(errno));
  }
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  int fd() const { return fd_; }
  // Closes after flushing to the disk; throws on failure.
  void sync_and_close(const std::string& path) {
    const int fd = fd_;
    fd_ = -1;
    if (::fsync(fd) != 0 || ::close(fd) != 0) throw CheckpointError(path + ": cannot write: " + std::strerror(errno));
  }

 private:
  int fd_;
};

void write_all(int fd, const std::string& path, const void* data, std::size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CheckpointError(path + ": cannot write: " + std::strerror(errno));
    done += static_cast<std::size_t>(n);
  }
}

std::string shard_name(std::size_t index, std::size_t count) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

void rename_or_throw(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) throw CheckpointError(to + ": cannot write: " + std::strerror(errno));
}

}  // namespace

bool SafetensorsSource::is_safetensors(const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::is_directory(path)) return fs::exists(fs::path(path) / kSingleFile) || fs::exists(fs::path(path) / kIndexFile);
  const std::string suffix = ".safetensors";
  return path.size() > suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
}

SafetensorsSource::SafetensorsSource(const std::string& path) : description_(path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(path)) {
    add_file(path, nullptr);
    return;
  }
  const fs::path index = fs::path(path) / kIndexFile;
  if (!fs::exists(index)) {
    if (!fs::exists(fs::path(path) / kSingleFile)) throw CheckpointError(path + ": no " + kSingleFile + " or " + kIndexFile);
    add_file((fs::path(path) / kSingleFile).string(), nullptr);
    return;
  }
  nlohmann::json document;
  try {
    std::ifstream in(index);
    document = nlohmann::json::parse(in);
  } catch (const std::exception& error) {
    throw CheckpointError(index.string() + ": not JSON: " + error.what());
  }
  if (!document.contains("weight_map") || !document["weight_map"].is_object()) {
    throw CheckpointError(index.string() + ": no \"weight_map\" object");
  }
  std::map<std::string, std::vector<std::string>> names_by_shard;
  for (const auto& [name, shard] : document["weight_map"].items()) {
    if (!shard.is_string()) throw CheckpointError(index.string() + ": the shard of '" + name + "' is not a file name");
    names_by_shard[shard.get<std::string>()].push_back(name);
  }
  for (const auto& [shard, names] : names_by_shard) {
    const fs::path file = fs::path(path) / shard;
    if (!fs::exists(file)) throw CheckpointError(file.string() + ": listed in " + kIndexFile + ", but missing");
    add_file(file.string(), &names);
  }
}

void SafetensorsSource::add_file(const std::string& file, const std::vector<std::string>* expected_names) {
  File handle(file, O_RDONLY);
  const auto file_size = static_cast<std::uint64_t>(std::filesystem::file_size(file));
  std::uint64_t header_size = 0;
  unsigned char length[8];
  read_at(handle.fd(), file, length, 8, 0);
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | length[i];
  if (header_size > kMaxHeaderBytes || 8 + header_size > file_size) {
    throw CheckpointError(file + ": not a safetensors file (header of " + std::to_string(header_size) + " bytes)");
  }
  std::string text(header_size, '\0');
  read_at(handle.fd(), file, text.data(), header_size, 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& error) {
    throw CheckpointError(file + ": its header is not JSON: " + error.what());
  }
  const std::uint64_t data_start = 8 + header_size;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      Entry parsed;
      parsed.file = file;
      const std::string dtype = entry.at("dtype").get<std::string>();
      const auto known = std::find_if(dtype_names().begin(), dtype_names().end(),
                                      [&](const auto& pair) { return pair.first == dtype; });
      if (known == dtype_names().end()) throw std::runtime_error("dtype " + dtype + " is not supported");
      parsed.dtype = known->second;
      parsed.shape = entry.at("shape").get<std::vector<std::int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<std::uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1]) throw std::runtime_error("bad data_offsets");
      parsed.begin = data_start + offsets[0];
      parsed.end = data_start + offsets[1];
      std::uint64_t elements = 1;
      for (auto size : parsed.shape) elements *= static_cast<std::uint64_t>(size);
      if (parsed.end > file_size || parsed.end - parsed.begin != elements * c10::elementSize(parsed.dtype)) {
        throw std::runtime_error("its data_offsets do not fit its shape and dtype, or pass the file's end");
      }
      if (!entries_.emplace(name, std::move(parsed)).second) throw std::runtime_error("it is in two files");
    } catch (const std::exception& error) {
      throw CheckpointError(file + ": tensor '" + name + "': " + error.what());
    }
  }
  if (expected_names) {
    for (const auto& name : *expected_names) {
      const auto found = entries_.find(name);
      if (found == entries_.end() || found->second.file != file) {
        throw CheckpointError(file + ": the index lists tensor '" + name + "' in it, but it is not there");
      }
    }
  }
}

std::vector<std::int64_t> SafetensorsSource::shape(const std::string& name) const { return entries_.at(name).shape; }

const std::string& SafetensorsSource::file_of(const std::string& name) const { return entries_.at(name).file; }

at::Tensor SafetensorsSource::read(const std::string& name) const {
  const Entry& entry = entries_.at(name);
  at::Tensor tensor = at::empty(entry.shape, at::TensorOptions(entry.dtype));
  File handle(entry.file, O_RDONLY);
  read_at(handle.fd(), entry.file, tensor.data_ptr(), entry.end - entry.begin, entry.begin);
  return tensor;
}

std::vector<std::string> SafetensorsSource::names() const {
  std::vector<std::string> names;
  for (const auto& [name, entry] : entries_) names.push_back(name);
  return names;
}

SafetensorsWriter::SafetensorsWriter(std::string directory, std::int64_t max_shard_bytes)
    : directory_(std::move(directory)), max_shard_bytes_(max_shard_bytes) {
  if (max_shard_bytes_ <= 0) throw CheckpointError("safetensors shards need a positive size limit");
  std::error_code error;
  std::filesystem::create_directories(directory_, error);
  if (error) throw CheckpointError(directory_ + ": cannot create the export's directory: " + error.message());
}

SafetensorsWriter::~SafetensorsWriter() {
  // An export that failed (a full disk) or was never finished leaves nothing behind: a shard written whole is
  // renamed by finish(), so only what did not make it is still here.
  for (const auto& path : shard_temporaries_) ::unlink(path.c_str());
  if (!index_temporary_.empty()) ::unlink(index_temporary_.c_str());
}

void SafetensorsWriter::add(const std::string& name, const at::Tensor& tensor) {
  if (shard_of_.count(name) ||
      std::any_of(pending_.begin(), pending_.end(), [&](const auto& entry) { return entry.first == name; })) {
    throw CheckpointError(directory_ + ": tensor '" + name + "' given twice");
  }
  dtype_name(tensor.scalar_type(), name);  // refused before anything is written
  const at::Tensor dense = tensor.detach().to(at::kCPU).contiguous();
  const auto bytes = static_cast<std::int64_t>(dense.nbytes());
  if (!pending_.empty() && pending_bytes_ + bytes > max_shard_bytes_) flush();
  pending_.emplace_back(name, dense);
  pending_bytes_ += bytes;
}

void SafetensorsWriter::flush() {
  if (pending_.empty()) return;
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : pending_) {
    header[name] = {{"dtype", dtype_name(tensor.scalar_type(), name)},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + tensor.nbytes()}}};
    offset += tensor.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as the reference writer keeps it
  const int index = static_cast<int>(shard_temporaries_.size());
  // The process's own: two exports into one directory do not write into each other's.
  const std::string path =
      directory_ + "/.shard-" + std::to_string(index) + "." + std::to_string(::getpid()) + ".safetensors.tmp";
  shard_temporaries_.push_back(path);  // removed by the destructor should the writes below fail
  File file(path, O_WRONLY | O_CREAT | O_TRUNC);
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  write_all(file.fd(), path, length, 8);
  write_all(file.fd(), path, text.data(), text.size());
  for (const auto& [name, tensor] : pending_) {
    write_all(file.fd(), path, tensor.data_ptr(), tensor.nbytes());
    shard_of_[name] = index;
  }
  file.sync_and_close(path);
  total_bytes_ += static_cast<std::int64_t>(offset);
  pending_.clear();
  pending_bytes_ = 0;
}

std::vector<std::string> SafetensorsWriter::finish() {
  namespace fs = std::filesystem;
  flush();
  if (shard_temporaries_.empty()) throw CheckpointError(directory_ + ": no tensors to export");
  const std::size_t count = shard_temporaries_.size();
  std::vector<std::string> files;
  for (std::size_t i = 0; i < count; ++i) files.push_back(count == 1 ? kSingleFile : shard_name(i, count));
  const fs::path index = fs::path(directory_) / kIndexFile;
  // Everything written before anything is renamed: a disk that fills up leaves an earlier export whole.
  if (count > 1) {
    nlohmann::ordered_json document;
    document["metadata"] = {{"total_size", total_bytes_}};
    for (const auto& [name, shard] : shard_of_) document["weight_map"][name] = files[static_cast<std::size_t>(shard)];
    const std::string text = document.dump(2);
    index_temporary_ = index.string() + "." + std::to_string(::getpid()) + ".tmp";
    File file(index_temporary_, O_WRONLY | O_CREAT | O_TRUNC);
    write_all(file.fd(), index_temporary_, text.data(), text.size());
    file.sync_and_close(index_temporary_);
  }
  for (std::size_t i = 0; i < count; ++i) {
    rename_or_throw(shard_temporaries_[i], (fs::path(directory_) / files[i]).string());
  }
  shard_temporaries_.clear();
  if (count > 1) {
    rename_or_throw(index_temporary_, index.string());
    index_temporary_.clear();
  }
  // What an earlier export left that this one does not use: its shards, and its index when this has none.
  const std::set<std::string> kept(files.begin(), files.end());
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(directory_, error)) {
    const std::string name = entry.path().filename().string();
    const bool shard = name == kSingleFile || (name.rfind("model-", 0) == 0 && entry.path().extension() == ".safetensors");
    if ((shard && !kept.count(name)) || (name == kIndexFile && count == 1)) fs::remove(entry.path(), error);
    if (error) break;
  }
  if (error) {
    throw CheckpointError(directory_ + ": exported, but an earlier export's files could not be removed: " +
                          error.message());
  }
  return files;
}

}  // namespace smp
