// The format, e.g. for make_gpipe(2, 1) lowered:
//   # smp schedule name=gpipe ranks=2 stages=2 microbatches=1 split_backward=0 stage_to_rank=0;1
//   rank,action,stage,microbatch,peer_stage
//   0,F,0,0,-1
//   0,SEND_F,0,0,1
//   ...
// Rows may come in any rank order; the rows of one rank are its actions in execution order. peer_stage is -1
// for compute actions. Blank lines are ignored. An evaluation's forwards alone (forward_only) add forward_only=1 to
// the metadata. read_csv checks the format only; run validate() on the result.

#include <cctype>
#include <charconv>
#include <istream>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "smp/scheduler/schedule.h"

namespace smp::sched {

namespace {

constexpr const char* kMetadataPrefix = "# smp schedule";
constexpr const char* kColumns = "rank,action,stage,microbatch,peer_stage";

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string::size_type begin = 0;
  while (true) {
    const std::string::size_type end = text.find(separator, begin);
    parts.push_back(text.substr(begin, end - begin));
    if (end == std::string::npos) return parts;
    begin = end + 1;
  }
}

class LineReader {
 public:
  explicit LineReader(std::istream& in) : in_(in) {}

  // The next non-blank line, without a trailing '\r' from files written on Windows.
  bool next(std::string& line) {
    while (std::getline(in_, line)) {
      ++number_;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") != std::string::npos) return true;
    }
    return false;
  }

  [[noreturn]] void fail(const std::string& problem) const {
    throw ScheduleError("schedule CSV line " + std::to_string(number_) + ": " + problem);
  }

  int parse_int(const std::string& text, const std::string& what) const {
    int value = 0;
    const char* end = text.data() + text.size();
    const auto [stop, error] = std::from_chars(text.data(), end, value);
    if (text.empty() || error != std::errc() || stop != end) fail(what + " '" + text + "' is not an integer");
    return value;
  }

  int parse_positive(const std::string& text, const std::string& what) const {
    const int value = parse_int(text, what);
    if (value < 1) fail(what + " must be at least 1, got " + text);
    return value;
  }

 private:
  std::istream& in_;
  int number_ = 0;
};

void read_metadata(LineReader& reader, const std::string& line, Schedule& schedule) {
  if (line.rfind(kMetadataPrefix, 0) != 0)
    reader.fail("expected the metadata line '" + std::string(kMetadataPrefix) + " name=... ranks=...'");
  std::map<std::string, std::string> fields;
  std::istringstream tokens(line.substr(std::string(kMetadataPrefix).size()));
  std::string token;
  while (tokens >> token) {
    const std::string::size_type equals = token.find('=');
    if (equals == std::string::npos) reader.fail("expected key=value, got '" + token + "'");
    fields[token.substr(0, equals)] = token.substr(equals + 1);
  }
  const auto take = [&](const char* key) {
    const auto found = fields.find(key);
    if (found == fields.end()) reader.fail(std::string("metadata lacks ") + key + "=");
    std::string value = found->second;
    fields.erase(found);
    return value;
  };

  schedule.name = take("name");
  schedule.num_ranks = reader.parse_positive(take("ranks"), "ranks");
  schedule.num_stages = reader.parse_positive(take("stages"), "stages");
  schedule.num_microbatches = reader.parse_positive(take("microbatches"), "microbatches");
  const std::string split_backward = take("split_backward");
  if (split_backward != "0" && split_backward != "1")
    reader.fail("split_backward must be 0 or 1, got '" + split_backward + "'");
  schedule.split_backward = split_backward == "1";
  for (const std::string& rank : split(take("stage_to_rank"), ';'))
    schedule.stage_to_rank.push_back(reader.parse_int(rank, "stage_to_rank entry"));
  if (static_cast<int>(schedule.stage_to_rank.size()) != schedule.num_stages)
    reader.fail("stage_to_rank lists " + std::to_string(schedule.stage_to_rank.size()) + " ranks for " +
                std::to_string(schedule.num_stages) + " stages");
  if (fields.count("forward_only")) {  // written only for an evaluation's schedule: earlier files lack it
    const std::string forward_only = take("forward_only");
    if (forward_only != "0" && forward_only != "1")
      reader.fail("forward_only must be 0 or 1, got '" + forward_only + "'");
    schedule.forward_only = forward_only == "1";
  }
  if (!fields.empty()) reader.fail("unknown metadata key '" + fields.begin()->first + "'");
  schedule.ranks.resize(static_cast<std::size_t>(schedule.num_ranks));
}

}  // namespace

void write_csv(const Schedule& schedule, std::ostream& out) {
  for (char c : schedule.name)
    if (std::isspace(static_cast<unsigned char>(c)))
      throw ScheduleError("write_csv: schedule name '" + schedule.name + "' contains whitespace");
  out << kMetadataPrefix << " name=" << schedule.name << " ranks=" << schedule.num_ranks
      << " stages=" << schedule.num_stages << " microbatches=" << schedule.num_microbatches
      << " split_backward=" << (schedule.split_backward ? 1 : 0) << " stage_to_rank=";
  for (std::size_t stage = 0; stage < schedule.stage_to_rank.size(); ++stage)
    out << (stage == 0 ? "" : ";") << schedule.stage_to_rank[stage];
  if (schedule.forward_only) out << " forward_only=1";
  out << '\n' << kColumns << '\n';
  for (std::size_t rank = 0; rank < schedule.ranks.size(); ++rank)
    for (const Action& action : schedule.ranks[rank])
      out << rank << ',' << to_string(action.kind) << ',' << action.stage << ',' << action.microbatch << ','
          << action.peer_stage << '\n';
  if (!out) throw ScheduleError("write_csv: writing schedule '" + schedule.name + "' failed");
}

Schedule read_csv(std::istream& in) {
  LineReader reader(in);
  std::string line;
  Schedule schedule;
  if (!reader.next(line)) reader.fail("empty input, expected the metadata line");
  read_metadata(reader, line, schedule);
  if (!reader.next(line) || line != kColumns) reader.fail(std::string("expected the column line '") + kColumns + "'");

  while (reader.next(line)) {
    const std::vector<std::string> fields = split(line, ',');
    if (fields.size() != 5)
      reader.fail("expected 5 fields (" + std::string(kColumns) + "), got " + std::to_string(fields.size()));
    const int rank = reader.parse_int(fields[0], "rank");
    if (rank < 0 || rank >= schedule.num_ranks)
      reader.fail("rank " + fields[0] + " out of range (the schedule has " + std::to_string(schedule.num_ranks) + ")");
    Action action{};
    try {
      action.kind = action_kind_from_string(fields[1]);
    } catch (const ScheduleError& error) {
      reader.fail(error.what());
    }
    action.stage = reader.parse_int(fields[2], "stage");
    action.microbatch = reader.parse_int(fields[3], "microbatch");
    action.peer_stage = reader.parse_int(fields[4], "peer_stage");
    schedule.ranks[rank].push_back(action);
  }
  return schedule;
}

}  // namespace smp::sched
