// Checkpoints, crashes and bad input, with real processes under smprun.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <csignal>
#include <filesystem>

#include "multiprocess.h"

using Catch::Matchers::Contains;
using namespace smp_test;

namespace {

std::string fresh_directory(const std::string& name) {
  const std::string path = scratch_path(name);
  REQUIRE(run_command("rm -rf " + path, 30).status == 0);
  return path;
}

std::string checkpoint_keys(const std::string& dir, int interval) {
  return R"(, "checkpoint_dir": ")" + dir + R"(", "checkpoint_interval": )" + std::to_string(interval);
}

std::string worker(const std::string& config, const std::string& flags) {
  return std::string(paths::smprun) + " -n 4 -- " + training_worker_command() + " --config " + config + " --optimizer adamw " + flags;
}

// The "0000N" of a directory's model-00001-of-0000N.safetensors.
std::string shard_count(const std::string& directory) {
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("model-00001-of-", 0) == 0) return name.substr(15, 5);
  }
  return "?";
}

void flip_byte(const std::string& path, std::streamoff offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(offset);
  char byte = 0;
  file.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x5a);
  file.seekp(offset);
  file.write(&byte, 1);
}

}  // namespace

TEST_CASE("the fp16 loss scale survives a checkpoint", "[faults][checkpoint][precision]") {
  const auto dir = fresh_directory("loss_scale");
  const auto config = write_config("loss_scale", smp_config(2, 1, 2, "interleaved", "cluster", 4, 30,
                                                            checkpoint_keys(dir, 1) + R"(, "fp16": true)"));
  // Step 1 overflows: the scale halves to 32768 and the checkpoint after step 2 keeps it.
  const auto first = run_worker(2, config, "--model gpt --steps 3 --spike-step 1 --rtol 0.02");
  INFO(first.output);
  REQUIRE(first.status == 0);
  CHECK_THAT(first.output, Contains("loss scale now 32768"));
  const auto resume_config = write_config("loss_scale_resume", smp_config(2, 1, 2, "interleaved", "cluster", 4, 30,
                                                                          checkpoint_keys(dir, 1) + R"(, "fp16": true, "resume": true)"));
  // The resumed job's overflow at step 4 halves the restored scale, not a fresh 65536.
  const auto resumed = run_worker(2, resume_config, "--model gpt --steps 6 --spike-step 1 --spike-step 4 --rtol 0.02");
  INFO(resumed.output);
  CHECK_THAT(resumed.output, Contains("step 4: fp16 gradients overflowed; skipping the step, loss scale now 16384"));
  check_clean_run(resumed, 2);
}

TEST_CASE("a killed rank stops the job, and resuming gives the uninterrupted losses bit for bit", "[faults][checkpoint]") {
  const auto uninterrupted_config = write_config("uninterrupted", smp_config(2, 2, 2, "interleaved", "cluster", 8, 20));
  // The learning rate halves every 2 steps (a StepLR whose step count the checkpoint keeps as program state).
  const auto uninterrupted = run_command(worker(uninterrupted_config, "--steps 6 --lr-step 2"), 120);
  INFO(uninterrupted.output);
  REQUIRE(uninterrupted.status == 0);
  const auto expected = step_losses(uninterrupted.output);
  REQUIRE(expected.size() == 6);

  const auto dir = fresh_directory("kill");
  const auto config = write_config("kill", smp_config(2, 2, 2, "interleaved", "cluster", 8, 20, checkpoint_keys(dir, 2)));
  // Killed at step 4's start: step 1's checkpoint is complete (each rank's save of step 3 waited for its save of
  // step 1), step 3's may or may not be.
  const auto killed = run_command(worker(config, "--steps 6 --kill-rank 1 --kill-step 4 --lr-step 2"), 120);
  INFO(killed.output);
  CHECK(killed.status != 0);
  CHECK(killed.status != 124);
  CHECK_THAT(killed.output, Contains("rank 1 was killed by signal SIGKILL"));
  CHECK(killed.seconds < 20 + 10);
  CHECK(std::filesystem::exists(dir + "/step-00000001/manifest.json"));
  const std::size_t saved_step = std::filesystem::exists(dir + "/step-00000003/manifest.json") ? 3 : 1;

  const auto resume_config = write_config("kill_resume", smp_config(2, 2, 2, "interleaved", "cluster", 8, 20,
                                                                    checkpoint_keys(dir, 2) + R"(, "resume": true)"));
  const auto continued = run_command(worker(resume_config, "--steps 6 --lr-step 2"), 120);
  INFO(continued.output);
  REQUIRE(continued.status == 0);
  CHECK_THAT(continued.output, Contains("resumed from " + dir + "/step-0000000" + std::to_string(saved_step)));
  CHECK(count_clean_ranks(continued.output) == 4);
  const auto after = step_losses(continued.output);
  REQUIRE(after.size() == 5 - saved_step);  // the steps after it, to 5
  for (std::size_t i = 0; i < after.size(); ++i) CHECK(after[i] == expected[i + saved_step + 1]);

  // A program that never calls resume() under "resume": true trains from its start, and its first save, a step
  // lower than the checkpoints there (pruning would delete it at once), is refused naming them.
  const auto forgot = run_command(worker(resume_config, "--steps 2 --skip-resume 1"), 120);
  INFO(forgot.output);
  CHECK(forgot.status != 0);
  CHECK_THAT(forgot.output, Contains("holds checkpoints up to step 5 of an earlier run, and this run, not resumed from "
                                     "them, saves step"));
}

TEST_CASE("a rank that stops answering makes the others fail within the timeout and names it", "[faults]") {
  const auto config = write_config("stopped", smp_config(2, 2, 2, "interleaved", "cluster", 8, 5));
  const auto result = run_worker(4, config, "--steps 4 --stop-rank 1 --stop-step 2", 120, "--grace 2");
  INFO(result.output);
  CHECK(result.status != 0);
  CHECK(result.status != 124);
  // Rank 1's pipeline peer (rank 0) waits for it and gives up after comm_timeout_s = 5 s; so does its replica peer
  // (rank 3) in the gradient all-reduce, which may be the first to tell.
  CHECK_THAT(result.output, (Contains("step 2, stage-rank 0") && Contains("receiving from rank 1 failed")) ||
                                Contains("rank 1, the group's other member, never joined"));
  CHECK(result.seconds < 5 + 2 + 20);
}

TEST_CASE("a checkpoint loads into another number of replicas and exports for another partitioning", "[faults][checkpoint]") {
  const auto dir = fresh_directory("reshape");
  const auto config = write_config("reshape", smp_config(2, 2, 2, "interleaved", "cluster", 8, 30, checkpoint_keys(dir, 3)));
  const auto saved = run_command(worker(config, "--steps 3"), 120);
  INFO(saved.output);
  REQUIRE(saved.status == 0);
  REQUIRE(std::filesystem::exists(dir + "/step-00000002/manifest.json"));

  // Two replicas saved it, one resumes it and trains on; parameters still equal single-process training.
  const auto one_replica = write_config("reshape_dp1", smp_config(2, 1, 4, "interleaved", "cluster", 8, 30,
                                                                  checkpoint_keys(dir, 0) + R"(, "resume": true)"));
  const auto resumed = run_worker(2, one_replica, "--optimizer adamw --steps 5");
  check_clean_run(resumed, 2);
  CHECK(step_losses(resumed.output).size() == 2);

  // Exported as one file, it loads into three stages and holds the state after step 2.
  const std::string exported = dir + "/full.pt";
  const auto export_run = run_command(std::string(paths::smp_checkpoint) + " export " + dir + "/step-00000002 " + exported, 60);
  INFO(export_run.output);
  REQUIRE(export_run.status == 0);
  const auto three_stages = write_config("reshape_pp3", smp_config(3, 1, 2, "interleaved", "cluster", 8, 30));
  const auto loaded = run_command(std::string(paths::smprun) + " -n 3 -- " + training_worker_command() + " --config " + three_stages +
                                      " --optimizer adamw --steps 0 --load-full " + exported + " --expect-step 2",
                                  120);
  check_clean_run(loaded, 3);

  // Exported as safetensors shards with an index (from_pretrained's layout), it loads the same way, each rank
  // reading only its own tensors.
  const std::string shards = dir + "/safetensors";
  const auto shard_run = run_command(std::string(paths::smp_checkpoint) + " export-safetensors " + dir +
                                         "/step-00000002 " + shards + " 512",
                                     60);
  INFO(shard_run.output);
  REQUIRE(shard_run.status == 0);
  CHECK(std::filesystem::exists(shards + "/model.safetensors.index.json"));
  CHECK(std::filesystem::exists(shards + "/model-00002-of-00002.safetensors") == false);  // far more than two shards
  const auto from_shards = run_command(std::string(paths::smprun) + " -n 3 -- " + training_worker_command() + " --config " +
                                           three_stages + " --optimizer adamw --steps 0 --load-full " + shards +
                                           " --expect-step 2",
                                       120);
  check_clean_run(from_shards, 3);

  // A shard that lost its tail is refused before anything is loaded, naming it.
  std::filesystem::resize_file(shards + "/model-00001-of-" + shard_count(shards) + ".safetensors", 16);
  const auto truncated = run_command(std::string(paths::smprun) + " -n 3 -- " + training_worker_command() + " --config " +
                                         three_stages + " --steps 0 --load-full " + shards + " --expect-step 2",
                                     120);
  CHECK(truncated.status != 0);
  CHECK_THAT(truncated.output, Contains("model-00001-of-"));
}

TEST_CASE("sharded optimizer state is saved per replica and resumes into any number of replicas",
          "[faults][checkpoint][zero]") {
  const auto dir = fresh_directory("zero");
  const std::string sharded = R"(, "shard_optimizer_state": true)";
  // A global batch of 12 splits into 1, 2 or 3 replicas x 2 microbatches: the same training whatever the count.
  const auto job = [&](const std::string& name, int replicas, const std::string& keys) {
    return write_config(name, smp_config(2, replicas, 2, "interleaved", "cluster", 12, 30, keys));
  };
  const auto run = [&](int replicas, const std::string& config, int steps) {
    return run_command(std::string(paths::smprun) + " -n " + std::to_string(2 * replicas) + " -- " + training_worker_command() +
                           " --config " + config + " --optimizer adamw --steps " + std::to_string(steps),
                       120);
  };
  const auto saved = run(2, job("zero", 2, checkpoint_keys(dir, 2) + sharded), 2);
  INFO(saved.output);
  REQUIRE(saved.status == 0);
  const std::string checkpoint = dir + "/step-00000001";
  for (const char* file : {"partition-0000.pt", "partition-0001.pt", "optimizer-0000-0001.pt", "optimizer-0001-0001.pt"}) {
    CHECK(std::filesystem::exists(checkpoint + "/" + file));
  }

  // Resumed, each replica must hold exactly the Adam moments of the parameters it now updates: the parameters then
  // equal plain training's after steps 2 to 4 (with a share lost, swapped or given to the wrong replica they would
  // not). The same sharding reads one share per replica; another count, or none, reads them all and keeps its own.
  const std::string resume = checkpoint_keys(dir, 0) + R"(, "resume": true)";
  // One saved job for every resume below (sections would run it again for each).
  {
    INFO("the same sharding");
    const auto resumed = run(2, job("zero_resume", 2, resume + sharded), 5);
    check_clean_run(resumed, 4);
    CHECK(step_losses(resumed.output).size() == 3);
  }
  {
    INFO("sharded over 3 replicas");
    const auto resumed = run(3, job("zero_resume_3", 3, resume + sharded), 5);
    check_clean_run(resumed, 6);
    CHECK_THAT(resumed.output, Contains("its optimizer state is sharded over 2 replicas, this job's sharded over 3"));
  }
  {
    INFO("not sharded, 2 replicas");
    check_clean_run(run(2, job("zero_unsharded", 2, resume), 5), 4);
  }
  {
    INFO("one replica");
    const auto resumed = run(1, job("zero_one_replica", 1, resume), 5);
    check_clean_run(resumed, 2);
    CHECK_THAT(resumed.output, Contains("every replica reads all 2 share(s) and keeps its own"));
  }
  {
    INFO("from unsharded state into shards");
    const auto plain_dir = fresh_directory("zero_from_plain");
    CHECK(run(1, job("zero_plain", 1, checkpoint_keys(plain_dir, 2)), 2).status == 0);
    check_clean_run(run(2, job("zero_plain_resume", 2, checkpoint_keys(plain_dir, 0) + R"(, "resume": true)" + sharded), 5),
                    4);
  }

  const auto verified = run_command(std::string(paths::smp_checkpoint) + " verify " + checkpoint, 60);
  CHECK_THAT(verified.output, Contains("optimizer state sharded over 2 replicas"));

  // The parameters alone still export (the shard files hold none) and load into three stages as they were after
  // step 1.
  const auto exported = run_command(std::string(paths::smp_checkpoint) + " export " + checkpoint + " " + dir + "/full.pt", 60);
  INFO(exported.output);
  REQUIRE(exported.status == 0);
  const auto three_stages = write_config("zero_pp3", smp_config(3, 1, 2, "interleaved", "cluster", 12, 30));
  check_clean_run(run_command(std::string(paths::smprun) + " -n 3 -- " + training_worker_command() + " --config " + three_stages +
                                  " --optimizer adamw --steps 0 --load-full " + dir + "/full.pt --expect-step 1",
                              120),
                  3);
}

TEST_CASE("corrupt and truncated checkpoints are refused with a clear error", "[faults][checkpoint]") {
  const auto dir = fresh_directory("corrupt");
  const auto config = write_config("corrupt", smp_config(2, 2, 2, "interleaved", "cluster", 8, 30, checkpoint_keys(dir, 1)));
  REQUIRE(run_command(worker(config, "--steps 2"), 120).status == 0);
  const std::string newest = dir + "/step-00000001", older = dir + "/step-00000000";
  flip_byte(newest + "/partition-0001.pt", 100);
  const auto verify = run_command(std::string(paths::smp_checkpoint) + " verify " + newest, 60);
  CHECK(verify.status == 1);
  CHECK_THAT(verify.output, Contains("partition-0001.pt: checksum mismatch"));
  // The root and one checkpoint mistaken for each other.
  const auto verify_root = run_command(std::string(paths::smp_checkpoint) + " verify " + dir, 60);
  CHECK(verify_root.status == 1);
  CHECK_THAT(verify_root.output, Contains("holds checkpoints") && Contains("smp_checkpoint list " + dir));
  const auto list_one = run_command(std::string(paths::smp_checkpoint) + " list " + newest, 60);
  CHECK(list_one.status == 1);
  CHECK_THAT(list_one.output, Contains("is one checkpoint, not a directory of them"));
  // A path that is not there, rather than a filesystem library's message or "the save did not finish".
  const auto missing = run_command(std::string(paths::smp_checkpoint) + " verify " + dir + "/step-99", 60);
  CHECK(missing.status == 1);
  CHECK_THAT(missing.output, Contains(dir + "/step-99 does not exist: give one checkpoint's directory"));

  std::filesystem::resize_file(older + "/partition-0000.pt", 10);
  const auto truncated = run_command(std::string(paths::smp_checkpoint) + " verify " + older, 60);
  CHECK(truncated.status == 1);
  CHECK_THAT(truncated.output, Contains("truncated or replaced"));

  // Resuming skips both, says why, and refuses to start over beside them (its first save would be refused) before
  // any step.
  const auto resume_config = write_config("corrupt_resume", smp_config(2, 2, 2, "interleaved", "cluster", 8, 30,
                                                                       checkpoint_keys(dir, 0) + R"(, "resume": true)"));
  const auto resumed = run_command(worker(resume_config, "--steps 1"), 120);
  INFO(resumed.output);
  CHECK(resumed.status == 1);
  CHECK_THAT(resumed.output, Contains("skipping checkpoint") && Contains("\"resume\": no checkpoint in " + dir) &&
                                 Contains("checksum mismatch") && Contains("truncated or replaced") &&
                                 !Contains("] step 0 loss"));
  // A save that never finished (no manifest) is a crash's leftover: the job starts over.
  std::filesystem::remove_all(older);
  std::filesystem::remove(newest + "/manifest.json");
  const auto fresh = run_command(worker(resume_config, "--steps 1"), 120);
  INFO(fresh.output);
  CHECK(fresh.status == 0);
  CHECK_THAT(fresh.output, Contains("the save did not finish") && Contains("no complete checkpoint"));
}

TEST_CASE("a checkpoint of another model is refused", "[faults][checkpoint]") {
  const auto dir = fresh_directory("other_model");
  const auto config = write_config("other_model", smp_config(2, 1, 2, "interleaved", "cluster", 4, 30, checkpoint_keys(dir, 1)));
  const auto first = run_worker(2, config, "--steps 1");
  INFO(first.output);
  REQUIRE(first.status == 0);
  const auto resume_config = write_config("other_model_resume", smp_config(2, 1, 2, "interleaved", "cluster", 4, 30,
                                                                           checkpoint_keys(dir, 0) + R"(, "resume": true)"));
  const auto refused = run_worker(2, resume_config, "--model gpt --steps 1");
  CHECK(refused.status != 0);
  CHECK_THAT(refused.output, Contains("holds another model") && Contains(": parameter 0 is "));
  INFO(refused.output);
}

TEST_CASE("a NaN loss stops the job naming the step, or skips the step when configured", "[faults][nonfinite]") {
  const auto stop_config = write_config("nan_stop", smp_config(2, 2, 2, "interleaved", "cluster", 8, 30));
  const auto stopped = run_command(worker(stop_config, "--steps 3 --nan-step 1"), 120);
  INFO(stopped.output);
  CHECK(stopped.status != 0);
  CHECK_THAT(stopped.output, Contains("step 1: the loss is nan") && Contains("non-finite gradients on rank"));

  const auto skip_config = write_config("nan_skip", smp_config(2, 2, 2, "interleaved", "cluster", 8, 30, R"(, "nonfinite": "skip")"));
  const auto skipped = run_command(worker(skip_config, "--steps 3 --nan-step 1"), 120);
  INFO(skipped.output);
  CHECK(skipped.status == 0);
  CHECK_THAT(skipped.output, Contains("step 1 skipped"));
  CHECK(count_clean_ranks(skipped.output) == 4);
}

TEST_CASE("a model that does not fit its data fails naming the stage and modules", "[faults][input]") {
  const auto config = write_config("bad_shapes", smp_config(2, 2, 2, "interleaved", "cluster", 8, 30));
  const auto result = run_command(worker(config, "--steps 1 --input-width 5"), 120);
  INFO(result.output);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("module \"0\" fails on the sample microbatch (input [2, 5])") &&
                                Contains("mat1 and mat2 shapes cannot be multiplied"));
  CHECK(result.output.find("frame #") == std::string::npos);  // no C++ backtraces
  CHECK(result.seconds < 30);
}

TEST_CASE("a second job on the same port fails clearly and leaves the first alone", "[faults][rendezvous]") {
  // A port that is free now; the first job takes it.
  const int port = [] {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
    socklen_t length = sizeof address;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
    ::close(fd);
    return static_cast<int>(ntohs(address.sin_port));
  }();
  const auto config = write_config("same_port", smp_config(2, 1, 2, "interleaved", "cluster", 4, 20));
  const std::string job = std::string(paths::smprun) + " -n 2 --master-port " + std::to_string(port) + " -- " +
                          training_worker_command() + " --config " + config;
  const std::string first_log = scratch_path("first_job.log");
  // At least 8 s of training, however fast the steps are: the second job comes while it trains.
  const std::string first = "OMP_NUM_THREADS=1 timeout -k 5 120 " + job + " --optimizer adamw --steps 80 --step-sleep-ms 100 > " +
                            first_log + " 2>&1";
  FILE* first_job = popen(first.c_str(), "r");
  REQUIRE(first_job != nullptr);
  ::sleep(2);
  const auto second = run_command(job + " --steps 1", 60);
  INFO(second.output);
  CHECK(second.status != 0);
  CHECK_THAT(second.output, Contains("port is in use") || Contains("belongs to another job"));
  CHECK(second.seconds < 30);
  const int raw = pclose(first_job);
  std::ifstream log(first_log);
  const std::string first_output((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  INFO(first_output);
  CHECK(WIFEXITED(raw));
  CHECK(WEXITSTATUS(raw) == 0);
  CHECK(count_clean_ranks(first_output) == 2);
}
