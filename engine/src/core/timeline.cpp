#include "smp/timeline.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace smp {
namespace {

constexpr int kSecondLaneTid = 1 << 20;  // above any rank

bool is_compute(const std::string& kind) { return kind == "F" || kind == "B" || kind == "I" || kind == "W"; }
bool is_collective(const std::string& kind) { return kind.rfind("TP_", 0) == 0 || kind.rfind("EP_", 0) == 0; }
bool tensor_parallel(const std::vector<RankTimeline>& ranks) {
  return std::any_of(ranks.begin(), ranks.end(), [](const RankTimeline& rank) { return rank.tp_rank > 0; });
}

const char* colour_of(const std::string& kind) {
  if (kind == "F") return "#4e79a7";
  if (kind == "B") return "#59a14f";
  if (kind == "I") return "#8cd17d";
  if (kind == "W") return "#f28e2b";
  return "#bab0ac";
}

}  // namespace

std::string RankTimeline::to_json() const {
  nlohmann::json document = {{"rank", rank},       {"pp_rank", pp_rank},
                              {"dp_rank", dp_rank}, {"tp_rank", tp_rank},
                              {"events", nlohmann::json::array()}};
  for (const auto& event : events) {
    document["events"].push_back({event.kind, event.stage, event.microbatch, event.start_us, event.end_us,
                                  event.peer_stage, event.second_lane});
  }
  return document.dump();
}

RankTimeline RankTimeline::from_json(const std::string& text) {
  try {
    const auto document = nlohmann::json::parse(text);
    RankTimeline timeline;
    timeline.rank = document.at("rank").get<int>();
    timeline.pp_rank = document.at("pp_rank").get<int>();
    timeline.dp_rank = document.at("dp_rank").get<int>();
    timeline.tp_rank = document.value("tp_rank", 0);
    for (const auto& event : document.at("events")) {
      timeline.events.push_back({event.at(0).get<std::string>(), event.at(1).get<int>(), event.at(2).get<int>(),
                                 event.at(3).get<double>(), event.at(4).get<double>(), event.at(5).get<int>(),
                                 event.size() > 6 && event.at(6).get<bool>()});
    }
    return timeline;
  } catch (const nlohmann::json::exception& error) {
    throw std::runtime_error(std::string("malformed timeline: ") + error.what());
  }
}

TimelineSummary summarize(const std::vector<RankTimeline>& ranks, int dp_rank) {
  TimelineSummary summary;
  double first = std::numeric_limits<double>::infinity(), last = -first;
  int pipeline_ranks = 0;
  for (const auto& rank : ranks) {
    if (rank.dp_rank != dp_rank) continue;
    ++pipeline_ranks;
    std::vector<std::pair<double, double>> computing;
    for (const auto& event : rank.events) {
      first = std::min(first, event.start_us);
      last = std::max(last, event.end_us);
      if (is_compute(event.kind)) computing.emplace_back(event.start_us, event.end_us);
      if (event.kind.rfind("RECV", 0) == 0) summary.receive_wait_us += event.end_us - event.start_us;
    }
    // Busy while any compute runs: an overlapped pair's forward and backward count once where they overlap.
    std::sort(computing.begin(), computing.end());
    double covered_until = -std::numeric_limits<double>::infinity();
    for (const auto& [start, end] : computing) {
      summary.busy_us += std::max(0.0, end - std::max(start, covered_until));
      covered_until = std::max(covered_until, end);
    }
  }
  // Match each receive with its send: (direction, from stage, to stage, microbatch). A transfer's latency runs from
  // the start of the send action (posting it is part of the cost) to the end of a receive that was already waiting.
  std::map<std::tuple<char, int, int, int>, double> send_started;
  for (const auto& rank : ranks) {
    if (rank.dp_rank != dp_rank) continue;
    for (const auto& event : rank.events) {
      if (event.kind == "SEND_F" || event.kind == "SEND_B") {
        send_started[{event.kind.back(), event.stage, event.peer_stage, event.microbatch}] = event.start_us;
      }
    }
  }
  double latency_sum = 0;
  int latency_samples = 0;
  for (const auto& rank : ranks) {
    if (rank.dp_rank != dp_rank) continue;
    for (const auto& event : rank.events) {
      if (event.kind != "RECV_F" && event.kind != "RECV_B") continue;
      const auto sent = send_started.find({event.kind.back(), event.peer_stage, event.stage, event.microbatch});
      if (sent == send_started.end() || event.start_us > sent->second) continue;  // sent before it was awaited
      latency_sum += std::max(0.0, event.end_us - sent->second);
      ++latency_samples;
    }
  }
  if (latency_samples > 0) summary.transfer_latency_us = latency_sum / latency_samples;
  if (pipeline_ranks == 0 || last <= first) return summary;
  summary.makespan_us = last - first;
  summary.bubble_fraction = 1.0 - summary.busy_us / (pipeline_ranks * summary.makespan_us);
  return summary;
}

std::string to_chrome_trace(const std::vector<RankTimeline>& ranks) {
  // One process per replica and one thread per pipeline rank, so Perfetto draws each pipeline as a block.
  nlohmann::json events = nlohmann::json::array();
  std::map<int, bool> named_replicas;
  for (const auto& rank : ranks) {
    if (!named_replicas[rank.dp_rank]) {
      named_replicas[rank.dp_rank] = true;
      events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank.dp_rank},
                        {"args", {{"name", "replica " + std::to_string(rank.dp_rank)}}}});
    }
    // Threads ordered by stage, then tensor-parallel shard: the global rank is unique in the replica.
    const std::string shard = rank.tp_rank > 0 || tensor_parallel(ranks) ? ", tp " + std::to_string(rank.tp_rank) : "";
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank.dp_rank}, {"tid", rank.rank},
                      {"args", {{"name", "rank " + std::to_string(rank.rank) + " (pp " + std::to_string(rank.pp_rank) + shard + ")"}}}});
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", rank.dp_rank}, {"tid", rank.rank},
                      {"args", {{"sort_index", (rank.pp_rank * 4096 + rank.tp_rank) * 2}}}});
    // Overlapped pairs' forwards (and their collectives) on a row of their own below the rank's: slices of one
    // row must nest, and these run beside the backwards.
    const int second_lane_tid = kSecondLaneTid + rank.rank;
    if (std::any_of(rank.events.begin(), rank.events.end(), [](const TimelineEvent& e) { return e.second_lane; })) {
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank.dp_rank}, {"tid", second_lane_tid},
                        {"args", {{"name", "rank " + std::to_string(rank.rank) + " overlapped forwards"}}}});
      events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", rank.dp_rank}, {"tid", second_lane_tid},
                        {"args", {{"sort_index", (rank.pp_rank * 4096 + rank.tp_rank) * 2 + 1}}}});
    }
    for (const auto& event : rank.events) {
      events.push_back({{"name", event.kind + std::to_string(event.microbatch)},
                        {"cat", is_compute(event.kind) ? "compute" : is_collective(event.kind) ? (event.kind[0] == 'E' ? "expert parallel" : "tensor parallel") : "transfer"},
                        {"ph", "X"},
                        {"ts", event.start_us},
                        {"dur", std::max(0.0, event.end_us - event.start_us)},
                        {"pid", rank.dp_rank},
                        {"tid", event.second_lane ? second_lane_tid : rank.rank},
                        {"args", {{"stage", event.stage}, {"microbatch", event.microbatch}}}});
    }
  }
  return nlohmann::json({{"traceEvents", events}, {"displayTimeUnit", "ms"}}).dump();
}

std::string to_svg(const std::vector<RankTimeline>& ranks, const std::string& title) {
  double first = std::numeric_limits<double>::infinity(), last = -first;
  for (const auto& rank : ranks) {
    for (const auto& event : rank.events) {
      first = std::min(first, event.start_us);
      last = std::max(last, event.end_us);
    }
  }
  if (!(last > first)) first = 0, last = 1;
  std::vector<const RankTimeline*> rows;
  for (const auto& rank : ranks) rows.push_back(&rank);
  std::sort(rows.begin(), rows.end(), [](const RankTimeline* a, const RankTimeline* b) {
    return std::tie(a->dp_rank, a->pp_rank, a->tp_rank) < std::tie(b->dp_rank, b->pp_rank, b->tp_rank);
  });
  const bool sharded = tensor_parallel(ranks);
  const double label_width = 150, plot_width = 1200, row_height = 28, top = 40;
  const double scale = plot_width / (last - first);
  const double height = top + row_height * static_cast<double>(rows.size()) + 40;
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << label_width + plot_width + 20 << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"10\" y=\"20\" font-size=\"14\">";
  for (char c : title) {
    if (c == '<') svg << "&lt;";
    else if (c == '&') svg << "&amp;";
    else svg << c;
  }
  svg << "</text>\n";
  for (std::size_t row = 0; row < rows.size(); ++row) {
    const double y = top + row_height * static_cast<double>(row);
    svg << "<text x=\"10\" y=\"" << y + row_height * 0.65 << "\">replica " << rows[row]->dp_rank << " stage-rank "
        << rows[row]->pp_rank << (sharded ? " tp " + std::to_string(rows[row]->tp_rank) : std::string()) << "</text>\n"
        << "<rect x=\"" << label_width << "\" y=\"" << y + 2 << "\" width=\"" << plot_width << "\" height=\""
        << row_height - 4 << "\" fill=\"#f4f4f4\"/>\n";
    for (const auto& event : rows[row]->events) {
      if (is_collective(event.kind)) {  // a dark strip along the bottom of the compute it runs in
        const double x = label_width + (event.start_us - first) * scale;
        svg << "<rect x=\"" << x << "\" y=\"" << y + row_height - 8 << "\" width=\""
            << std::max(0.5, (event.end_us - event.start_us) * scale) << "\" height=\"5\" fill=\"#333333\"><title>"
            << event.kind << " stage " << event.stage << " microbatch " << event.microbatch << "</title></rect>\n";
        continue;
      }
      if (!is_compute(event.kind)) continue;
      const double x = label_width + (event.start_us - first) * scale;
      const double width = std::max(0.5, (event.end_us - event.start_us) * scale);
      // An overlapped pair's forward covers the upper half of the backward it ran beside.
      const double bar_height = event.second_lane ? (row_height - 4) / 2 : row_height - 4;
      svg << "<rect x=\"" << x << "\" y=\"" << y + 2 << "\" width=\"" << width << "\" height=\"" << bar_height
          << "\" fill=\"" << colour_of(event.kind) << "\" stroke=\"white\" stroke-width=\"0.5\"><title>" << event.kind
          << " stage " << event.stage << " microbatch " << event.microbatch
          << (event.second_lane ? " (overlapped)" : "") << "</title></rect>\n";
      if (width > 14 && !event.second_lane) {
        svg << "<text x=\"" << x + width / 2 << "\" y=\"" << y + row_height * 0.65
            << "\" text-anchor=\"middle\" fill=\"white\">" << event.microbatch << "</text>\n";
      }
    }
  }
  const double legend_y = top + row_height * static_cast<double>(rows.size()) + 20;
  double legend_x = label_width;
  for (const char* kind : {"F", "B", "I", "W"}) {
    svg << "<rect x=\"" << legend_x << "\" y=\"" << legend_y - 10 << "\" width=\"12\" height=\"12\" fill=\""
        << colour_of(kind) << "\"/><text x=\"" << legend_x + 16 << "\" y=\"" << legend_y << "\">" << kind << "</text>\n";
    legend_x += 50;
  }
  char span[64];
  std::snprintf(span, sizeof span, "%.2f ms", (last - first) / 1000.0);
  svg << "<text x=\"" << legend_x + 20 << "\" y=\"" << legend_y << "\">gray = idle; "
      << (sharded ? "dark strips = tensor-parallel collectives; " : "") << "width = " << span << "</text>\n</svg>\n";
  return svg.str();
}

void write_file_atomically(const std::string& path, std::string_view contents) {
  const std::string temporary = path + ".tmp." + std::to_string(getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + temporary + ": " + std::strerror(errno));
  std::size_t written = 0;
  while (written < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + written, contents.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      ::close(fd);
      ::unlink(temporary.c_str());
      throw std::runtime_error("cannot write " + temporary + ": " + std::strerror(error));
    }
    written += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0 || ::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(error));
  }
}

}  // namespace smp
