"""smp.plan: layouts predicted by simulation for a captured Hugging Face model, ranked, and rejected by the memory
limit (plan_check.py, one process)."""

from jobs import assert_passed


def test_plan_ranks_layouts_and_rejects_by_memory(job):
    assert_passed(job(1, "plan_check.py"))
