#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <set>

#include <nlohmann/json.hpp>

#include "smp/timeline.h"

using namespace smp;
using Catch::Matchers::Contains;

namespace {
// Two pipeline ranks of one replica: rank 0 busy 0-10 and 30-40, rank 1 busy 10-30; makespan 40, busy 40 of 80.
std::vector<RankTimeline> two_ranks() {
  RankTimeline first{0, 0, 0, {{"F", 0, 0, 0, 9}, {"SEND_F", 0, 0, 9, 10, 1}, {"RECV_B", 0, 0, 10, 30, 1}, {"B", 0, 0, 30, 40}}};
  RankTimeline second{1, 1, 0, {{"RECV_F", 1, 0, 0, 10, 0}, {"F", 1, 0, 10, 15}, {"B", 1, 0, 15, 28},
                                {"SEND_B", 1, 0, 28, 29, 0}}};
  return {first, second};
}
}  // namespace

TEST_CASE("timeline: bubble and receive waits of one replica", "[timeline]") {
  const auto summary = summarize(two_ranks(), 0);
  CHECK(summary.makespan_us == 40);
  CHECK(summary.busy_us == 40 - 1 - 2);  // sends are not compute
  CHECK(summary.bubble_fraction == Approx(1.0 - 37.0 / 80.0));
  CHECK(summary.receive_wait_us == 30);
  // RECV_F waited from 0 and ended 1 us after its send started (9 -> 10); RECV_B waited from 10 and ended 2 us
  // after its send started (28 -> 30): mean 1.5 us.
  CHECK(summary.transfer_latency_us == Approx(1.5));
  CHECK(summarize(two_ranks(), 1).makespan_us == 0);
}

TEST_CASE("timeline: JSON round trip and malformed input", "[timeline]") {
  const auto rank = two_ranks()[1];
  const auto back = RankTimeline::from_json(rank.to_json());
  CHECK(back.rank == 1);
  REQUIRE(back.events.size() == 4);
  CHECK(back.events[2].kind == "B");
  CHECK(back.events[2].end_us == 28);
  CHECK(back.events[3].peer_stage == 0);
  CHECK_THROWS_WITH(RankTimeline::from_json("{\"rank\": 1}"), Contains("malformed timeline"));
}

TEST_CASE("timeline: Chrome trace and SVG", "[timeline]") {
  const auto trace = nlohmann::json::parse(to_chrome_trace(two_ranks()));
  int complete_events = 0;
  for (const auto& event : trace.at("traceEvents")) {
    if (event.at("ph") == "X") ++complete_events;
  }
  CHECK(complete_events == 8);
  const auto svg = to_svg(two_ranks(), "1f1b <test> & co");
  CHECK_THAT(svg, Contains("<svg") && Contains("</svg>") && Contains("1f1b &lt;test> &amp; co"));
  CHECK_THAT(svg, Contains("replica 0 stage-rank 1") && Contains("#4e79a7"));
}

TEST_CASE("timeline: an overlapped pair's forward has a row of its own and counts once as busy", "[timeline]") {
  // Rank 0 runs B of stage 0 from 0 to 10 and, beside it on the second lane, F of stage 1 from 5 to 12.
  RankTimeline rank{0, 0, 0, {{"B", 0, 0, 0, 10}, {"F", 1, 1, 5, 12, -1, true}}};
  CHECK(summarize({rank}, 0).busy_us == 12);
  CHECK(RankTimeline::from_json(rank.to_json()).events[1].second_lane);
  CHECK_FALSE(RankTimeline::from_json(rank.to_json()).events[0].second_lane);
  std::set<int> threads;
  const auto trace = nlohmann::json::parse(to_chrome_trace({rank}));
  for (const auto& event : trace.at("traceEvents")) {
    if (event.at("ph") == "X") threads.insert(event.at("tid").get<int>());
  }
  CHECK(threads.size() == 2);
  CHECK_THAT(to_svg({rank}, "pairs"), Contains("microbatch 1 (overlapped)"));
}

TEST_CASE("timeline: files are written whole or not at all", "[timeline]") {
  const std::string path = "/tmp/smp_timeline_test_" + std::to_string(getpid()) + ".json";
  write_file_atomically(path, "first");
  write_file_atomically(path, "second");
  std::ifstream in(path);
  CHECK(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()) == "second");
  std::remove(path.c_str());
  CHECK_THROWS_WITH(write_file_atomically("/nonexistent-dir/x.json", "x"), Contains("cannot write"));
}
