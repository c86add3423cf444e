"""smp.plan: layouts predicted by simulation for a captured Hugging Face model, ranked, and rejected by the memory
limit (plan_check.py, one process); "auto" layout keys: the job trains in the layout rank 0 planned, adopted by
every rank (real_models.py)."""

import json

from jobs import assert_passed, smp_keys

PLANNED = ("partitions", "microbatches", "pipeline", "ddp", "activation_checkpointing", "shard_optimizer_state")


def test_plan_ranks_layouts_and_rejects_by_memory(job):
    assert_passed(job(1, "plan_check.py"))


def test_a_teacher_beside_a_planned_model_is_cut_freely(job):
    """The planned cut pins the student's modules; a teacher of another architecture built after it trains beside it
    (it was refused: the pins named modules it lacks)."""
    finished = job(2, "two_models_auto_check.py")
    assert_passed(finished)
    assert "this frozen model holds " in finished.output
    assert "beside the planned model's predicted peak" in finished.output
    assert "to plan room for this one, lower memory_limit_mb by " in finished.output


def rank0_lines(output, prefix):
    return [line.split("] ", 1)[1] for line in output.splitlines()
            if line.startswith("[rank 0] ") and line.split("] ", 1)[1].startswith(prefix)]


def test_auto_layout_fits_the_memory_limit_and_trains_equal_pytorch(job):
    """With every layout key "auto" and a memory limit just under what the fastest layout needs, the job trains in
    another layout that fits, on every rank alike, equals plain PyTorch, and reports its measured step beside the
    predicted one."""
    keys = smp_keys(global_batch_size=8)
    planned = job(1, "real_models.py", "--models", "gpt2", "--plan", "4", "--smp", keys)
    assert planned.returncode == 0, planned.output
    fastest = json.loads(rank0_lines(planned.stdout, '{"model"')[0])
    config = dict(json.loads(keys), memory_limit_mb=fastest["peak_mib"] - 0.01, **{key: "auto" for key in PLANNED})
    finished = job(4, "real_models.py", "--models", "gpt2", "--steps", "5", "--smp", json.dumps(config))
    assert_passed(finished)
    chosen = rank0_lines(finished.stdout, "smp: planned layout ")
    assert chosen, finished.output
    # The limit bound: the plan needs less than the fastest did. It may be the fastest's layout cut otherwise (a split
    # that keeps every stage within the limit), which is why the peak is compared and not the layout's name.
    peak = float(chosen[0].split(", peak ")[1].split()[0])
    assert peak <= config["memory_limit_mb"] < fastest["peak_mib"], chosen[0]
    # Four ranks on this host's cores: planned with the processors they had computing at once, measured.
    links = rank0_lines(finished.stdout, "smp: links measured: ")
    assert links, finished.output
    if "processors" in links[0]:
        processors = float(links[0].split(" had ")[1].split()[0])
        assert 0.5 <= processors <= 4, links[0]
    # After five steps, the measured step beside the prediction.
    assert any("train_step measured" in line and "predicted" in line for line in chosen), finished.output


def test_auto_tensor_parallel_degree_shards_the_model_and_trains_equal_pytorch(job):
    """"tensor_parallel_degree": "auto" among the planned keys: with one stage and no replicas on 2 ranks the only
    layout is tp 2, which the job adopts, sharding the model by its own plan, and trains equal to plain PyTorch. The
    ranks' devices differ (device_speeds): the group is planned at its slower member's speed."""
    config = dict(json.loads(smp_keys(global_batch_size=8)), tensor_parallel_degree="auto", partitions=1, ddp=False,
                  microbatches="auto", device_speeds=[1.0, 0.5])
    finished = job(2, "real_models.py", "--models", "gpt2", "--steps", "3", "--smp", json.dumps(config))
    assert_passed(finished)
    chosen = rank0_lines(finished.stdout, "smp: planned layout ")
    assert chosen and chosen[0].startswith("smp: planned layout tp 2 x pp 1 x dp 1, "), finished.output
    # The report ranks what the job can adopt: pipelines of 2 stages and replicas are excluded, counted per key the
    # config fixes.
    excluded = [line for line in finished.stdout.splitlines() if "excluded by the keys the config fixes" in line]
    assert excluded and " partitions " in excluded[0] and " ddp " in excluded[0], finished.output


def test_auto_expert_parallel_degree_divides_the_experts_when_memory_asks(job):
    """"expert_parallel_degree": "auto" on a mixture of experts: with 2 replicas and a memory limit that only
    layouts dividing the experts meet, the job adopts ep 2 (each rank holding half of every experts tensor, the
    tokens exchanged) and trains equal to plain PyTorch."""
    keys = dict(json.loads(smp_keys(global_batch_size=8)), partitions=1, ddp=True, microbatches="auto",
                expert_parallel_degree="auto")
    planned = job(1, "real_models.py", "--models", "mixtral_wide", "--plan", "2", "--smp", json.dumps(keys))
    assert planned.returncode == 0, planned.output
    least = json.loads(rank0_lines(planned.stdout, '{"model"')[0])["least_peak_mib_by_ep"]
    assert {"1", "2"} <= set(least) and least["2"] < least["1"], least
    # Beside tensor parallelism on 4 ranks: at ep 1 the model's own plan splits the experts over tp 2; at ep 2 each
    # tp rank holds them whole and divides them by 2, the same state, more activations.
    beside = job(1, "real_models.py", "--models", "mixtral_wide", "--plan", "4", "--smp",
                 json.dumps(dict(keys, tensor_parallel_degree="auto")))
    assert beside.returncode == 0, beside.output
    by_tp = json.loads(rank0_lines(beside.stdout, '{"model"')[0])["least_peak_mib_by_tp_ep"]
    assert {"1,1", "1,2", "2,1", "2,2"} <= set(by_tp), by_tp
    assert by_tp["1,2"] < by_tp["1,1"] and by_tp["2,2"] >= by_tp["2,1"], by_tp
    config = dict(keys, memory_limit_mb=(least["1"] + least["2"]) / 2)
    finished = job(2, "real_models.py", "--models", "mixtral_wide", "--steps", "5", "--smp", json.dumps(config))
    assert_passed(finished)
    chosen = rank0_lines(finished.stdout, "smp: planned layout ")
    assert chosen and chosen[0].startswith("smp: planned layout pp 1 x dp 2, ep 2, "), finished.output
    # After five steps, the routing the exchanges met beside the plan's, each uneven (random routers).
    routing = [line for line in chosen if "routing measured: the busiest rank got " in line]
    assert routing, finished.output
    measured, planned = (float(part.split("x")[0]) for part in
                         (routing[0].split(" got ")[1], routing[0].rsplit(" planned ", 1)[1]))
    assert measured > 1.0 and planned > 1.0, routing[0]


def test_fixed_expert_and_tensor_parallel_degrees_beside_auto_keys_train_equal_pytorch(job):
    """Degrees the config fixes beside "auto" keys, tp 2 x ep 2 on 4 ranks: rank 0 plans with the experts whole
    (capturing them divided would cut the model's own experts before the job does) on the tp 2 profile, where each
    tensor-parallel rank holds its experts whole and divides them with the other replica's; every layout keeps both
    degrees, and the job trains equal to plain PyTorch (attention sharded by the model's own plan, the experts whole
    on each tensor-parallel rank and divided over the replicas)."""
    config = dict(json.loads(smp_keys(global_batch_size=8)), partitions=1, ddp=True, microbatches=2,
                  activation_checkpointing="auto", shard_optimizer_state="auto", tensor_parallel_degree=2,
                  expert_parallel_degree=2)
    finished = job(4, "real_models.py", "--models", "mixtral", "--steps", "2", "--smp", json.dumps(config))
    assert_passed(finished)
    chosen = rank0_lines(finished.stdout, "smp: planned layout ")
    assert chosen and chosen[0].startswith("smp: planned layout tp 2 x pp 1 x dp 2, ep 2, "), finished.output
