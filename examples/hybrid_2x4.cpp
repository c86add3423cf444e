// The hybrid job: a GPT-style decoder on real text, as 2 data-parallel replicas x 4 pipeline stages when run
// with 8 processes (`smprun -n 8 -- hybrid_2x4 --config examples/hybrid_2x4.json`). Any partitions x replicas
// that the config allows works; the loss sequence depends only on the seed and the global batch.

#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "common/gpt.h"
#include "common/text_corpus.h"
#include "smp/checkpoint.h"
#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"
#include "smp/main.h"
#include "smp/runtime.h"

namespace {

struct TrainingOptions {
  int64_t steps = 30;
  int64_t sequence_length = 64;
  double learning_rate = 3e-3;
  double clip_grad_norm = 0.0;  // 0: no clipping
};

TrainingOptions training_options(const nlohmann::json& section, const std::string& source) {
  TrainingOptions options;
  if (section.is_null()) return options;
  if (!section.is_object()) throw smp::ConfigError(source + ": key \"training\": expected an object");
  for (auto it = section.begin(); it != section.end(); ++it) {
    const std::string key = "training." + it.key();
    auto fail = [&](const std::string& expected) {
      throw smp::ConfigError(source + ": key \"" + key + "\": expected " + expected + ", got " + it.value().dump());
    };
    if (it.key() == "steps" || it.key() == "sequence_length") {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 1 || it.value().get<int64_t>() > 100000000) {
        fail("a positive integer");
      }
      (it.key() == "steps" ? options.steps : options.sequence_length) = it.value().get<int64_t>();
    } else if (it.key() == "learning_rate" || it.key() == "clip_grad_norm") {
      if (!it.value().is_number() || it.value().get<double>() < 0 || it.value().get<double>() > 1e6) {
        fail("a non-negative number");
      }
      (it.key() == "learning_rate" ? options.learning_rate : options.clip_grad_norm) = it.value().get<double>();
    } else {
      throw smp::ConfigError(source + ": unknown key \"" + key + "\"");
    }
  }
  return options;
}

const char* kUsage =
    "usage: hybrid_2x4 --config FILE [--steps N] [--data DIR] [--trace DIR] [--resume]\n"
    "  Trains a small GPT on Debian's fortunes corpus with the partitions/microbatches/ddp of FILE.\n"
    "  --trace DIR writes the timeline of the second step (Chrome trace JSON and SVG) to DIR.\n"
    "  --resume continues from the newest complete checkpoint in the config's checkpoint_dir.\n"
    "  Launch partitions x replicas processes, e.g. smprun -n 8 -- hybrid_2x4 --config examples/hybrid_2x4.json\n";

int run(int argc, char** argv) {
  std::string config_path, data_dir = smp::examples::kDefaultCorpusDir, trace_dir;
  int64_t steps_override = 0;
  bool resume = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw smp::ConfigError(flag + " needs a value\n" + kUsage);
      return argv[++i];
    };
    if (flag == "--config") {
      config_path = value();
    } else if (flag == "--steps") {
      const std::string text = value();
      try {
        steps_override = std::stoll(text);
      } catch (const std::exception&) {
        steps_override = -1;
      }
      if (steps_override < 1) throw smp::ConfigError("--steps: expected a positive integer, got \"" + text + "\"");
    } else if (flag == "--data") {
      data_dir = value();
    } else if (flag == "--resume") {
      resume = true;
    } else if (flag == "--trace") {
      trace_dir = value();
    } else if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      throw smp::ConfigError("unknown flag \"" + flag + "\"\n" + kUsage);
    }
  }
  if (config_path.empty()) throw smp::ConfigError(std::string("--config is required\n") + kUsage);

  smp::Config config = smp::Config::from_file(config_path);
  config.check_sections({"model", "training"});
  auto model_options = smp::examples::gpt_options_from_section(config.application("model").dump(), config.source);
  model_options.sequence_parallel = config.sequence_parallel;
  auto training = training_options(config.application("training"), config.source);
  if (steps_override > 0) training.steps = steps_override;
  if (resume) {
    if (config.checkpoint_dir.empty()) throw smp::ConfigError("--resume needs \"checkpoint_dir\" in " + config.source);
    config.resume = true;
  }
  if (!trace_dir.empty()) {
    config.trace_dir = trace_dir;
    config.trace_step = training.steps > 1 ? 1 : 0;  // the first step pays for warm-up
  }
  if (config.global_batch_size == 0) {
    throw smp::ConfigError(config.source + ": key \"smp.global_batch_size\" is required by this example");
  }
  if (training.sequence_length > model_options.context) {
    throw smp::ConfigError(config.source + ": key \"training.sequence_length\" (" +
                           std::to_string(training.sequence_length) + ") exceeds model.context (" +
                           std::to_string(model_options.context) + ")");
  }
  const auto corpus = smp::examples::TextCorpus::load(data_dir, training.sequence_length + 2);

  auto runtime = smp::Runtime::init(config);
  at::manual_seed(config.seed);
  // With "tensor_parallel_degree" > 1 the blocks, embedding and output layer hold this rank's shards.
  auto model = smp::examples::make_gpt(model_options, runtime->tensor_parallel_group());
  const auto loss = smp::examples::gpt_loss_for(runtime->tensor_parallel_group());
  const int64_t global_batch = config.global_batch_size;
  const int64_t microbatch = global_batch / runtime->topology().data_parallel_degree() / config.microbatches;
  const auto sample = corpus.batch(config.seed, -1, microbatch, training.sequence_length).first;
  smp::DistributedModel distributed(runtime, model, sample);
  if (runtime->rank() == 0) {
    std::printf("corpus: %zu bytes from %d files in %s\n", corpus.size(), corpus.file_count(), data_dir.c_str());
  }
  smp::DistributedOptimizer optimizer(
      distributed, std::make_unique<torch::optim::AdamW>(
                       distributed.parameters(), torch::optim::AdamWOptions(training.learning_rate).weight_decay(0.0)));

  smp::Checkpointer checkpointer(distributed, optimizer);
  const int64_t first_step = checkpointer.resume();
  for (int64_t step = first_step; step < training.steps; ++step) {
    const auto [inputs, targets] = corpus.batch(config.seed, step, global_batch, training.sequence_length);
    optimizer.zero_grad();
    const auto output =
        distributed.train_step(runtime->replica_slice(inputs), runtime->replica_slice(targets), loss);
    if (training.clip_grad_norm > 0) optimizer.clip_grad_norm(training.clip_grad_norm);
    optimizer.step();
    if (runtime->rank() == 0) {
      std::printf("step %lld loss %.6f samples/s %.1f\n", static_cast<long long>(step), output.loss,
                  static_cast<double>(global_batch) / output.seconds);
      std::fflush(stdout);
    }
    if (checkpointer.due(step)) checkpointer.save(step);
  }
  // Validation on batches training never drew (negative step numbers), without gradients. The logits come back on
  // the rank running the last stage, for its replica's share: each such rank counts its correct next-byte
  // guesses, and one all-reduce over every rank sums them.
  double validation = 0.0;
  at::Tensor guesses = at::zeros({2}, at::kDouble);  // right, all
  constexpr int kValidationBatches = 2;
  for (int i = 0; i < kValidationBatches; ++i) {
    const auto [inputs, targets] = corpus.batch(config.seed, -2 - i, global_batch, training.sequence_length);
    const at::Tensor replica_targets = runtime->replica_slice(targets);
    const smp::StepOutput evaluation =
        distributed.evaluate(runtime->replica_slice(inputs), replica_targets, loss, /*keep_outputs=*/true);
    validation += evaluation.loss / kValidationBatches;
    if (evaluation.outputs.defined()) {
      // Each tensor-parallel rank holds its share of the vocabulary's logits: put together, counted by one.
      const at::Tensor logits = smp::tp::gather_last_dim(evaluation.outputs, runtime->tensor_parallel_group());
      if (runtime->tp_rank() != 0) continue;
      guesses[0] += logits.argmax(-1).cpu().eq(replica_targets).sum().item<double>();
      guesses[1] += static_cast<double>(replica_targets.numel());
    }
  }
  runtime->world().all_reduce_sum(guesses);
  if (runtime->rank() == 0) {
    std::printf("validation loss %.6f\n", validation);
    std::printf("validation next-byte accuracy %.6f\n", guesses[0].item<double>() / guesses[1].item<double>());
  }
  if (checkpointer.enabled() && first_step < training.steps) checkpointer.save(training.steps - 1);
  checkpointer.wait();  // saves are written in the background: the last one must be complete before exiting
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
