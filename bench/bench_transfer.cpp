// One transfer's cost between two pipeline processes, under smprun -n 2: a ping-pong of one activation-sized tensor
// (a) over Gloo's send and receive, posted before the peer sends (what torch.distributed offers), (b) the same
// over the group's point-to-point channels once connected (the transport the executor uses), and (c) through smp's
// transfer protocol as the executor uses it (header, layouts remembered, payloads posted ahead). Prints one JSON line
// (rank 0) with the median and the 90th percentile one-way time of each, in microseconds.
//
//   smprun -n 2 -- bench_transfer [--kib 16] [--rounds 400]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "smp/comm/tensor_transfer.h"
#include "smp/main.h"
#include "smp/runtime.h"

namespace {

double percentile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
}

int run(int argc, char** argv) {
  int kib = 16, rounds = 400;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--kib") kib = std::stoi(argv[i + 1]);
    else if (flag == "--rounds") rounds = std::stoi(argv[i + 1]);
    else throw smp::ConfigError("bench_transfer: unknown flag " + flag);
  }
  auto runtime = smp::Runtime::init(
      smp::Config::from_json_text(R"({"partitions": 2, "device": "cpu", "log_level": "warn"})", "bench_transfer"));
  auto& group = runtime->pipeline();
  const int me = group.rank(), peer = 1 - me;
  const at::Tensor payload = at::randn({kib * 256});
  constexpr int kWarmup = 20;

  // (a) Bare: the receive of each round posted before the peer can send it (the round before).
  auto bare_ping_pong = [&] {
    std::vector<double> one_way;
    at::Tensor buffer = at::empty_like(payload);
    std::unique_ptr<smp::comm::Pending> next;
    if (me == 0) next = group.irecv(buffer, peer, 2);
    for (int round = 0; round < kWarmup + rounds; ++round) {
      const auto start = std::chrono::steady_clock::now();
      if (me == 0) {
        group.isend(payload, peer, 1)->wait();
        next->wait();
        next = group.irecv(buffer, peer, 2);
      } else {
        at::Tensor in = at::empty_like(payload);
        group.irecv(in, peer, 1)->wait();
        group.isend(payload, peer, 2)->wait();
      }
      if (round >= kWarmup) {
        one_way.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 2);
      }
    }
    if (me == 1) group.isend(payload, peer, 2)->wait();  // the receive rank 0 posted last
    if (me == 0) next->wait();
    group.barrier();
    return one_way;
  };
  const std::vector<double> gloo = bare_ping_pong();  // Gloo's send and receive: before the channel is connected
  group.connect({{0, 1}, {1, 0}});
  const std::vector<double> bare = bare_ping_pong();

  // (b) The executor's protocol: a tag per transfer as in a step, layouts remembered across rounds.
  std::vector<double> protocol;
  smp::comm::TransferLayouts layouts;
  for (int round = 0; round < kWarmup + rounds; ++round) {
    const int there = 64, back = 128;  // two transfers of a step, the same tags every step
    smp::comm::IncomingTensors incoming(group, peer, me == 0 ? back : there, "bench receive", &layouts);
    incoming.post_expected();
    group.barrier();  // both have posted, as the executor posts a step's receives at its start
    const auto start = std::chrono::steady_clock::now();
    if (me == 0) {
      auto sent = smp::comm::send_tensors(group, {payload}, peer, there, "bench send", &layouts);
      incoming.wait();
      sent->wait();
    } else {
      incoming.wait();
      smp::comm::send_tensors(group, {payload}, peer, back, "bench send", &layouts)->wait();
    }
    if (round >= kWarmup) {
      protocol.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 2);
    }
  }
  if (me == 0) {
    std::printf("{\"kib\": %d, \"gloo_one_way_us\": %.1f, \"gloo_p90_us\": %.1f, \"bare_one_way_us\": %.1f, "
                "\"bare_p90_us\": %.1f, \"smp_one_way_us\": %.1f, \"smp_p90_us\": %.1f}\n",
                kib, percentile(gloo, 0.5), percentile(gloo, 0.9), percentile(bare, 0.5), percentile(bare, 0.9),
                percentile(protocol, 0.5), percentile(protocol, 0.9));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
