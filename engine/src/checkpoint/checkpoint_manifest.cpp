#include "smp/checkpoint_manifest.h"

#include <algorithm>
#include <cstdio>
#include <ftw.h>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>
#include <zlib.h>

namespace smp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

bool safe_file_name(const std::string& name) {
  if (name.empty() || name.size() > 128 || name == "." || name == "..") return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  });
}

// Only the names saves give their directories (step-%08lld): pruning removes what it finds, and a directory of the
// user's, say step-0000007, is not a save.
std::optional<std::int64_t> step_of_directory(const std::string& name) {
  if (name.size() < 13 || name.rfind("step-", 0) != 0 || (name.size() > 13 && name[5] == '0')) return std::nullopt;
  std::int64_t step = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i])) || step > (INT64_MAX / 10 - 10)) return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// Checkpoint directories under root, newest first.
std::vector<std::pair<std::int64_t, fs::path>> checkpoint_directories(const std::string& root) {
  std::vector<std::pair<std::int64_t, fs::path>> found;
  std::error_code error;
  if (!fs::is_directory(root, error)) return found;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    if (!entry.is_directory(error)) continue;
    if (auto step = step_of_directory(entry.path().filename().string())) found.emplace_back(*step, entry.path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

}  // namespace

std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t crc) {
  // zlib's CRC-32 (the same polynomial as zip and gzip) runs several times faster than a byte table.
  const auto* bytes = static_cast<const Bytef*>(data);
  while (size > 0) {
    const auto chunk = static_cast<uInt>(std::min<std::size_t>(size, 1u << 30));
    crc = static_cast<std::uint32_t>(::crc32(crc, bytes, chunk));
    bytes += chunk;
    size -= chunk;
  }
  return crc;
}

std::pair<std::uint32_t, std::uint64_t> crc32_of_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(path + ": cannot open");
  std::vector<char> buffer(1 << 20);
  std::uint32_t crc = 0;
  std::uint64_t size = 0;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto got = static_cast<std::size_t>(in.gcount());
    crc = crc32(buffer.data(), got, crc);
    size += got;
  }
  if (in.bad()) throw CheckpointError(path + ": read error");
  return {crc, size};
}

std::string checkpoint_directory_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

namespace {
std::string with_shard(std::string name, int tp_rank) {
  if (tp_rank < 0) return name;
  char shard[16];
  std::snprintf(shard, sizeof shard, "-tp%02d", tp_rank);
  return name.insert(name.size() - 3, shard);  // before ".pt"
}
}  // namespace

std::string partition_file_name(int pp_rank, int tp_rank, int ep_rank) {
  char name[40];
  if (ep_rank > 0) {
    std::snprintf(name, sizeof name, "partition-%04d-ep%02d.pt", pp_rank, ep_rank);
  } else {
    std::snprintf(name, sizeof name, "partition-%04d.pt", pp_rank);
  }
  return with_shard(name, tp_rank);
}

std::string optimizer_shard_file_name(int pp_rank, int dp_rank, int tp_rank) {
  char name[40];
  std::snprintf(name, sizeof name, "optimizer-%04d-%04d.pt", pp_rank, dp_rank);
  return with_shard(name, tp_rank);
}

std::string CheckpointManifest::to_json() const {
  json files_json = json::array();
  for (const auto& file : files) {
    json entry = {{"name", file.name}, {"pp_rank", file.pp_rank}, {"size", file.size}, {"crc32", file.crc32}};
    if (file.dp_rank >= 0) entry["dp_rank"] = file.dp_rank;
    if (tensor_parallel_degree > 1) entry["tp_rank"] = file.tp_rank;
    if (file.ep_rank > 0) entry["ep_rank"] = file.ep_rank;
    files_json.push_back(entry);
  }
  json document({{"format_version", kFormatVersion},
               {"step", step},
               {"partitions", partitions},
               {"virtual_stages", virtual_stages},
               {"replicas", replicas},
               {"optimizer_shards", optimizer_shards},
               {"schedule", schedule},
               {"module_names", module_names},
               {"stage_of_module", stage_of_module},
               {"model_signature", model_signature},
               {"seed", seed},
               {"config", config_json},
               {"files", files_json}});
  if (tensor_parallel_degree > 1) document["tensor_parallel_degree"] = tensor_parallel_degree;
  if (expert_parallel_degree > 1) document["expert_parallel_degree"] = expert_parallel_degree;
  if (!model_parameters.empty()) document["model_parameters"] = model_parameters;
  return document.dump(2);
}

CheckpointManifest CheckpointManifest::parse(const std::string& text, const std::string& source) {
  auto fail = [&](const std::string& problem) -> CheckpointError {
    return CheckpointError(source + ": " + problem);
  };
  json document;
  try {
    document = json::parse(text);
  } catch (const json::exception& error) {
    throw fail(std::string("not a valid manifest (") + error.what() + ")");
  }
  if (!document.is_object()) throw fail("not a valid manifest (expected an object)");
  auto field = [&](const char* key, auto check, const char* expected) -> const json& {
    if (!document.contains(key)) throw fail(std::string("missing \"") + key + "\"");
    const json& value = document[key];
    if (!check(value)) throw fail(std::string("\"") + key + "\" must be " + expected);
    return value;
  };
  auto is_count = [](const json& v) { return v.is_number_integer() && v.get<long long>() >= 0 && v.get<long long>() <= (1 << 20); };
  if (field("format_version", is_count, "an integer").get<int>() != kFormatVersion) {
    throw fail("format version " + document["format_version"].dump() + " is not supported (expected " +
               std::to_string(kFormatVersion) + ")");
  }
  CheckpointManifest manifest;
  const json& step = field("step", [](const json& v) { return v.is_number_integer() && v.get<long long>() >= 0; }, "a non-negative integer");
  manifest.step = step.get<std::int64_t>();
  manifest.partitions = field("partitions", is_count, "a count").get<int>();
  manifest.virtual_stages = field("virtual_stages", is_count, "a count").get<int>();
  manifest.replicas = field("replicas", is_count, "a count").get<int>();
  // Absent in checkpoints written before the optimizer state could be sharded.
  if (document.contains("optimizer_shards")) manifest.optimizer_shards = field("optimizer_shards", is_count, "a count").get<int>();
  if (document.contains("tensor_parallel_degree")) {
    manifest.tensor_parallel_degree = field("tensor_parallel_degree", is_count, "a count").get<int>();
  }
  if (document.contains("expert_parallel_degree")) {
    manifest.expert_parallel_degree = field("expert_parallel_degree", is_count, "a count").get<int>();
  }
  if (manifest.partitions < 1 || manifest.virtual_stages < 1 || manifest.replicas < 1 || manifest.optimizer_shards < 1 ||
      manifest.tensor_parallel_degree < 1 || manifest.expert_parallel_degree < 1) {
    throw fail("counts must be positive");
  }
  if (manifest.expert_parallel_degree > 1 && manifest.optimizer_shards > 1 &&
      manifest.optimizer_shards % manifest.expert_parallel_degree != 0) {
    throw fail("expert_parallel_degree (" + std::to_string(manifest.expert_parallel_degree) +
               ") does not divide optimizer_shards (" + std::to_string(manifest.optimizer_shards) + ")");
  }
  if (manifest.optimizer_shards > 1 && manifest.optimizer_shards != manifest.replicas) {
    throw fail("optimizer_shards (" + std::to_string(manifest.optimizer_shards) + ") must equal replicas (" +
               std::to_string(manifest.replicas) + ") when above 1");
  }
  manifest.schedule = field("schedule", [](const json& v) { return v.is_string(); }, "a string").get<std::string>();
  manifest.model_signature = field("model_signature", [](const json& v) { return v.is_string(); }, "a string").get<std::string>();
  manifest.config_json = field("config", [](const json& v) { return v.is_string(); }, "a string").get<std::string>();
  if (document.contains("model_parameters")) {
    if (!document["model_parameters"].is_string()) throw fail("model_parameters must be a string");
    manifest.model_parameters = document["model_parameters"].get<std::string>();
  }
  manifest.seed = field("seed", [](const json& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<long long>() >= 0); }, "a non-negative integer").get<std::uint64_t>();
  const json& names = field("module_names", [](const json& v) { return v.is_array(); }, "a list");
  const json& stages = field("stage_of_module", [](const json& v) { return v.is_array(); }, "a list");
  if (names.size() != stages.size()) throw fail("module_names and stage_of_module differ in length");
  // Each count may be up to 2^20, so their product can overflow int.
  const long long num_stages = static_cast<long long>(manifest.partitions) * manifest.virtual_stages;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!names[i].is_string()) throw fail("module_names must hold strings");
    if (!stages[i].is_number_integer() || stages[i].get<long long>() < 0 || stages[i].get<long long>() >= num_stages) {
      throw fail("stage_of_module[" + std::to_string(i) + "] is not a stage below " + std::to_string(num_stages));
    }
    manifest.module_names.push_back(names[i].get<std::string>());
    manifest.stage_of_module.push_back(stages[i].get<int>());
  }
  const json& files = field("files", [](const json& v) { return v.is_array(); }, "a list");
  // covered[pp][tp][replica]: the replicas below expert_parallel_degree write partition files (one, replica 0's,
  // without expert parallelism), the later ones below optimizer_shards files of their optimizer state's share.
  const auto shards = static_cast<std::size_t>(manifest.tensor_parallel_degree);
  const int first_shard_file = manifest.expert_parallel_degree;
  const auto slots = static_cast<std::size_t>(std::max(manifest.optimizer_shards, manifest.expert_parallel_degree));
  std::vector<std::vector<std::vector<bool>>> covered(
      static_cast<std::size_t>(manifest.partitions),
      std::vector<std::vector<bool>>(shards, std::vector<bool>(slots, false)));
  for (const auto& file : files) {
    if (!file.is_object() || !file.contains("name") || !file["name"].is_string() || !file.contains("pp_rank") ||
        !file["pp_rank"].is_number_integer() || !file.contains("size") || !file["size"].is_number_unsigned() ||
        !file.contains("crc32") || !file["crc32"].is_number_unsigned() || file["crc32"].get<std::uint64_t>() > 0xFFFFFFFFu ||
        (file.contains("dp_rank") && !file["dp_rank"].is_number_integer()) ||
        (file.contains("tp_rank") && !file["tp_rank"].is_number_integer()) ||
        (file.contains("ep_rank") && !file["ep_rank"].is_number_integer())) {
      throw fail("a files entry must have name, pp_rank, size and crc32 (and an integer dp_rank, tp_rank and ep_rank, "
                 "if any)");
    }
    // Range-checked before narrowing: 4294967297 must not wrap to a valid rank.
    const long long pp_rank = file["pp_rank"].get<long long>();
    if (pp_rank < 0 || pp_rank >= manifest.partitions) {
      throw fail("file " + file["name"].get<std::string>() + " has pp_rank " + std::to_string(pp_rank) +
                 ", outside [0, " + std::to_string(manifest.partitions - 1) + "]");
    }
    const bool shard = file.contains("dp_rank");
    const long long dp_rank = shard ? file["dp_rank"].get<long long>() : 0;
    if (shard && (dp_rank < first_shard_file || dp_rank >= manifest.optimizer_shards)) {
      throw fail("file " + file["name"].get<std::string>() + " has dp_rank " + std::to_string(dp_rank) +
                 (manifest.optimizer_shards > first_shard_file
                      ? ", outside [" + std::to_string(first_shard_file) + ", " +
                            std::to_string(manifest.optimizer_shards - 1) + "]"
                      : ", but no replica writes an optimizer shard file"));
    }
    const long long tp_rank = file.contains("tp_rank") ? file["tp_rank"].get<long long>() : 0;
    if (tp_rank < 0 || tp_rank >= manifest.tensor_parallel_degree) {
      throw fail("file " + file["name"].get<std::string>() + " has tp_rank " + std::to_string(tp_rank) +
                 ", outside [0, " + std::to_string(manifest.tensor_parallel_degree - 1) + "]");
    }
    const long long ep_rank = file.contains("ep_rank") ? file["ep_rank"].get<long long>() : 0;
    if (ep_rank < 0 || ep_rank >= manifest.expert_parallel_degree || (ep_rank > 0 && shard)) {
      throw fail("file " + file["name"].get<std::string>() + " has ep_rank " + std::to_string(ep_rank) +
                 (shard ? " beside a dp_rank" : ", outside [0, " + std::to_string(manifest.expert_parallel_degree - 1) + "]"));
    }
    CheckpointFile entry{file["name"].get<std::string>(), static_cast<int>(pp_rank), file["size"].get<std::uint64_t>(),
                         static_cast<std::uint32_t>(file["crc32"].get<std::uint64_t>()),
                         shard ? static_cast<int>(dp_rank) : -1, static_cast<int>(tp_rank), static_cast<int>(ep_rank)};
    if (!safe_file_name(entry.name)) throw fail("unsafe file name \"" + entry.name + "\"");
    const auto slot = static_cast<std::size_t>(shard ? dp_rank : ep_rank);
    auto&& seen = covered[entry.pp_rank][static_cast<std::size_t>(tp_rank)][slot];
    if (seen) {
      throw fail("file " + entry.name + " has a repeated pp_rank " + std::to_string(entry.pp_rank) +
                 (shard ? " and dp_rank " + std::to_string(dp_rank) : std::string()) +
                 (manifest.tensor_parallel_degree > 1 ? " and tp_rank " + std::to_string(tp_rank) : std::string()) +
                 (ep_rank > 0 ? " and ep_rank " + std::to_string(ep_rank) : std::string()));
    }
    seen = true;
    manifest.files.push_back(entry);
  }
  for (int rank = 0; rank < manifest.partitions; ++rank) {
    for (std::size_t tp = 0; tp < shards; ++tp) {
      const std::string shard = shards > 1 ? " shard " + std::to_string(tp) : std::string();
      if (!covered[rank][tp][0]) throw fail("no file for pipeline rank " + std::to_string(rank) + shard);
      for (int share = 1; share < manifest.expert_parallel_degree; ++share) {
        if (!covered[rank][tp][static_cast<std::size_t>(share)]) {
          throw fail("no file for pipeline rank " + std::to_string(rank) + shard + " experts share " +
                     std::to_string(share));
        }
      }
      for (int replica = first_shard_file; replica < manifest.optimizer_shards; ++replica) {
        if (!covered[rank][tp][static_cast<std::size_t>(replica)]) {
          throw fail("no optimizer shard file for pipeline rank " + std::to_string(rank) + shard + " replica " +
                     std::to_string(replica));
        }
      }
    }
  }
  return manifest;
}

CheckpointManifest read_manifest(const std::string& directory) {
  const std::string manifest_path = directory + "/manifest.json";
  std::ifstream in(manifest_path, std::ios::binary);
  if (!in) throw CheckpointError(manifest_path + ": missing " + kUnfinishedSave);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return CheckpointManifest::parse(text, manifest_path);
}

CheckpointManifest verify_checkpoint(const std::string& directory) {
  auto manifest = read_manifest(directory);
  for (const auto& file : manifest.files) {
    const std::string path = directory + "/" + file.name;
    const auto [crc, size] = crc32_of_file(path);
    if (size != file.size) {
      throw CheckpointError(path + ": " + std::to_string(size) + " bytes, the manifest says " + std::to_string(file.size) +
                            " (truncated or replaced)");
    }
    if (crc != file.crc32) throw CheckpointError(path + ": checksum mismatch (the file is corrupt)");
  }
  return manifest;
}

std::optional<FoundCheckpoint> find_latest_checkpoint(const std::string& root, std::vector<std::string>* skipped) {
  for (const auto& [step, path] : checkpoint_directories(root)) {
    try {
      return FoundCheckpoint{path.string(), verify_checkpoint(path.string())};
    } catch (const CheckpointError& error) {
      if (skipped) skipped->push_back(error.what());
    }
  }
  return std::nullopt;
}

namespace {

// Not std::filesystem::remove_all: libtorch.so exports its own copy of std::filesystem, which the dynamic linker
// binds in every program linked with LibTorch, and that remove_all crashes (SIGSEGV) there. Removes what it can,
// depth first, without following links.
void remove_tree(const std::string& path) {
  const auto remove_entry = [](const char* entry, const struct stat*, int, struct FTW*) {
    ::remove(entry);
    return 0;  // go on with the rest
  };
  nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

}  // namespace

namespace {

bool files_complete(const std::string& directory) {
  try {
    const auto manifest = read_manifest(directory);
    std::error_code error;
    for (const auto& file : manifest.files) {
      if (fs::file_size(directory + "/" + file.name, error) != file.size || error) return false;
    }
    return true;
  } catch (const CheckpointError&) {
    return false;
  }
}

}  // namespace

std::optional<std::int64_t> highest_saved_step(const std::string& root) {
  for (const auto& [step, path] : checkpoint_directories(root)) {
    std::error_code error;
    if (fs::exists(path / "manifest.json", error)) return step;
  }
  return std::nullopt;
}

void prune_checkpoints(const std::string& root, int keep) {
  int complete_seen = 0;
  for (const auto& [step, path] : checkpoint_directories(root)) {
    const bool complete = files_complete(path.string());
    // An incomplete directory newer than every complete one may be a save still in progress: leave it.
    const bool remove = complete ? ++complete_seen > keep : complete_seen > 0;
    if (remove) remove_tree(path.string());
  }
}

}  // namespace smp
