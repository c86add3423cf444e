"""Expert parallelism: unmodified Hugging Face mixture-of-experts models with their experts divided over ranks
("expert_parallel_degree"), against plain PyTorch on the same microbatches (real_models.py: every loss, every
parameter within 1e-5 relative, each rank holding 1/ep of every experts tensor), and the all-to-all under it. With
tensor parallelism: test_planning.py's fixed tp 2 x ep 2 job."""

import json

from jobs import assert_passed, smp_keys


def test_all_to_all_moves_rows_and_gradients(job):
    """Uneven row counts (none between some ranks) arrive in rank order within each block of replicas; gradients go
    back reversed."""
    assert_passed(job(4, "ep_checks.py"))


def test_ep2_x_dp2_equal_pytorch(job, tmp_path):
    """4 replicas in 2 blocks: expert gradients averaged over the 2 replicas holding the same experts, dense ones over
    all 4; a loss function on the outputs; the optimizer state sharded (ZeRO-1), the experts' over the 2 replicas
    holding them. The traced step's timeline shows the exchanges inside the compute. Evaluation of 8 samples, and of 7,
    too few to give every replica its 2 microbatches, which the exchanges need: refused on every rank."""
    assert_passed(job(4, "real_models.py", "--models", "mixtral,olmoe", "--loss", "fn", "--eval-samples", "8,7",
                      "--smp",
                      smp_keys(partitions=1, microbatches=2, ddp=True, expert_parallel_degree=2,
                               shard_optimizer_state=True,
                               global_batch_size=8, trace_dir=str(tmp_path), trace_step=1)))
    events = json.loads((tmp_path / "step1_trace.json").read_text())["traceEvents"]
    exchanges = [event for event in events if event.get("cat") == "expert parallel"]
    # olmoe's 4 layers (the last model traced): dispatch and combine, forward and backward, 2 microbatches, 4 ranks.
    assert len(exchanges) == 4 * 4 * 2 * 4


def test_ep2_x_pp2_meta_equal_materialized(job):
    """Shared experts and grouped routing (DeepSeek-V3) beside Mixtral, built on the meta device (each rank makes its
    own experts of its own stages real), under ZB-H1 with the first stage recomputed: the exchanges run again in
    the recompute, and the split backward moves the gradients back."""
    assert_passed(job(4, "real_models.py", "--meta", "--models", "mixtral,deepseek_v3", "--smp",
                      smp_keys(partitions=2, microbatches=4, pipeline="zero_bubble", activation_checkpointing=[0],
                               ddp=True, expert_parallel_degree=2, global_batch_size=8)))


def test_dualpipe_v_overlapped_pairs_equal_pytorch(job, tmp_path):
    """DualPipeV under ep 2 x pp 2 with its pairs overlapped: each pair's forward on a second thread, its
    all-to-alls over communicators of their own, beside the other stage's backward. Equal to plain PyTorch; the
    traced step shows the forwards, with their exchanges, on a row of their own, running while backwards run."""
    assert_passed(job(4, "real_models.py", "--models", "mixtral", "--steps", "2", "--smp",
                      smp_keys(partitions=2, microbatches=4, pipeline="dualpipe_v", overlap_forward_backward=True,
                               ddp=True, expert_parallel_degree=2, global_batch_size=16, trace_dir=str(tmp_path),
                               trace_step=1)))
    spans = [event for event in json.loads((tmp_path / "step1_trace.json").read_text())["traceEvents"]
             if event.get("ph") == "X"]
    second_lane = [event for event in spans if event["tid"] >= 1 << 20]
    forwards = [event for event in second_lane if event["cat"] == "compute"]
    assert forwards and all(event["name"].startswith("F") for event in forwards)
    assert any(event["cat"] == "expert parallel" for event in second_lane)

    def beside(forward, other):
        return other["ts"] < forward["ts"] + forward["dur"] and forward["ts"] < other["ts"] + other["dur"]
    assert any(other["tid"] == forward["tid"] - (1 << 20) and other["cat"] == "compute" and other["name"][0] in "BIW"
               and beside(forward, other) for forward in forwards for other in spans)
