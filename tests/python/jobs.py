"""Launching a test's job and reading what its ranks report (report.py); the fixtures are in conftest.py."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def smprun_path():
    path = os.environ.get("SMP_SMPRUN") or shutil.which("smprun") or os.path.join(REPO, "build", "bin", "smprun")
    if not os.path.exists(path):
        pytest.fail(f"smprun not found at {path}: build smp first, or set SMP_SMPRUN")
    return path


class Job:
    """A finished job: its exit status, output, and the failures its ranks reported."""

    def __init__(self, command, result, failures):
        self.command, self.returncode = command, result.returncode
        self.stdout, self.stderr, self.failures = result.stdout, result.stderr, failures

    @property
    def output(self):
        """The end of what it printed, for an assertion's message."""
        return f"$ {' '.join(self.command)}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-5000:]}"

    @property
    def error(self):
        """Its last line on stderr: what a checking script exits with."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else f"exit status {self.returncode}, nothing on stderr"


def python_command():
    """How a rank's interpreter starts: a fork of the warm pool's (warm_pool.py) where SMP_WARM_POOL names one, a new
    python where not (the same job either way)."""
    if os.environ.get("SMP_WARM_POOL"):
        return [sys.executable, os.path.join(HERE, "warm_pool.py"), "run"]
    return [sys.executable]


def python_executable(directory):
    """python_command() as one executable, for the checking scripts that launch jobs themselves."""
    if not os.environ.get("SMP_WARM_POOL"):
        return sys.executable
    path = os.path.join(directory, "python")
    with open(path, "w") as file:
        file.write("#!/bin/sh\nexec " + " ".join(f"'{part}'" for part in python_command()) + ' "$@"\n')
    os.chmod(path, 0o755)
    return path


def launcher(tmp_path):
    """run(processes, script, *args): runs tests/python/SCRIPT with ARGS in PROCESSES ranks (0: one plain process,
    for scripts that launch jobs themselves) and returns a Job; by="torchrun" launches the ranks with torchrun
    (standalone: its own store on a free port) in place of smprun."""

    def run(processes, script, *args, timeout=240, by="smprun"):
        reports = tmp_path / f"reports-{len(list(tmp_path.iterdir()))}"
        reports.mkdir()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SMP_TEST_REPORTS=str(reports))
        path = script if os.path.isabs(script) else os.path.join(HERE, script)
        command = [*python_command(), path, *map(str, args)]
        if processes > 0 and by == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(processes), "--no-python"] + command
        elif processes > 0:
            command = [smprun_path(), "-n", str(processes), "--timeout", str(timeout), "--"] + command
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout + 60)
        except subprocess.TimeoutExpired as expired:
            pytest.fail(f"{' '.join(command)} did not end within {timeout + 60} s:\n{expired.stdout}\n{expired.stderr}")
        failures = []
        for report in sorted(glob.glob(str(reports / "rank*.json"))):
            with open(report) as file:
                failures += json.load(file)["failures"]
        return Job(command, result, failures)

    return run


def smp_keys(**keys):
    """An smp config as the --smp argument of the workers takes it."""
    return json.dumps(dict({"seed": 3, "device": "cpu"}, **keys))


def assert_passed(job):
    """Every rank reported no failure, and the job ended cleanly."""
    assert job.failures == []
    assert job.returncode == 0, job.output
