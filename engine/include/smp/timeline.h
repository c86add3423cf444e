#pragma once
// What the pipeline did: every rank's actions with start and end times, merged into a Chrome trace (opens in
// Perfetto) and an SVG picture (ranks as rows, F/B/I/W coloured, microbatch numbers, bubbles visible).
// Plain C++: the engine records, this file only formats and measures.

#include <string>
#include <string_view>
#include <vector>

namespace smp {

struct TimelineEvent {
  // "F", "B", "I", "W", "RECV_F", "SEND_F", "RECV_B", "SEND_B"; "TP_ALL_REDUCE", "TP_ALL_GATHER", "EP_ALL_TO_ALL":
  // a tensor- or expert-parallel collective inside the compute event of the same stage and microbatch.
  std::string kind;
  int stage = 0;
  int microbatch = 0;
  double start_us = 0.0;  // wall clock, microseconds since the epoch
  double end_us = 0.0;
  int peer_stage = -1;    // transfers: the stage at the other end
  // The forward of an overlapped pair ("overlap_forward_backward"), on its own thread, and the collectives it ran.
  bool second_lane = false;
};

struct RankTimeline {
  int rank = 0;
  int pp_rank = 0;
  int dp_rank = 0;
  std::vector<TimelineEvent> events;
  int tp_rank = 0;

  std::string to_json() const;
  static RankTimeline from_json(const std::string& text);  // throws std::runtime_error on malformed input
};

struct TimelineSummary {
  double makespan_us = 0.0;   // first start to last end over the ranks of one replica
  double busy_us = 0.0;       // compute time (F, B, I, W) summed over those ranks
  double bubble_fraction = 0.0;  // 1 - busy / (pipeline ranks * makespan)
  double receive_wait_us = 0.0;  // time blocked in receives: communication not hidden behind compute
  // Mean time from the start of a send action (posting it is part of the cost) to its receive completing, over
  // receives that were already waiting then: what one transfer costs on this link (0 when no receive waited).
  double transfer_latency_us = 0.0;
};

// Summary of the ranks of replica `dp_rank`.
TimelineSummary summarize(const std::vector<RankTimeline>& ranks, int dp_rank);

std::string to_chrome_trace(const std::vector<RankTimeline>& ranks);
std::string to_svg(const std::vector<RankTimeline>& ranks, const std::string& title);

// Writes `contents` to `path` atomically: a temporary file in the same folder, fsync, rename.
void write_file_atomically(const std::string& path, std::string_view contents);

}  // namespace smp
