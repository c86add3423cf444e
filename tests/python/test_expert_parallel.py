"""Expert parallelism's building blocks against what they must do, on 4 processes."""

from jobs import assert_passed


def test_all_to_all_moves_rows_and_gradients(job):
    """Uneven row counts (none between some ranks) arrive in rank order; gradients go back reversed."""
    assert_passed(job(4, "ep_checks.py"))
