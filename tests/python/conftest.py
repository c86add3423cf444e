"""Fixtures for smp's Python tests. A test launches its job, a script of this folder under smprun (one intra-op
thread per process, a free port picked by smprun, a time limit), and asserts on what the ranks report (report.py):
`job.failures` lists each failure as one readable line naming its rank. ctest runs each test as
`python -m pytest tests/python/FILE::TEST` with SMP_SMPRUN naming the launcher; by hand:

    SMP_SMPRUN=build/bin/smprun PYTHONPATH=build/python python -m pytest tests/python -k real_models
"""

import pytest

pytest.register_assert_rewrite("jobs")  # its assertions explain themselves as a test's do

import jobs  # noqa: E402


@pytest.fixture
def smprun():
    return jobs.smprun_path()


@pytest.fixture
def python(tmp_path):
    """The interpreter a checking script starts its jobs' ranks with (jobs.python_executable)."""
    return jobs.python_executable(str(tmp_path))


@pytest.fixture
def job(tmp_path):
    """job(processes, script, *args) -> jobs.Job: see jobs.launcher."""
    return jobs.launcher(tmp_path)
