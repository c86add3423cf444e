"""How a test script run under smprun tells pytest what failed: each rank writes its failures (one readable line each)
to a JSON file in $SMP_TEST_REPORTS, which conftest.py's job fixture collects for the test's assertions. Run by hand,
the script prints them and exits 1."""

import json
import os
import sys


def finish(failures, label=None):
    """Prints and records this rank's failures; returns the exit status (0 when there are none)."""
    rank = os.environ.get("RANK", "0")
    label = label or f"rank {rank}"
    for failure in failures:
        print(f"[{label}] {failure}", file=sys.stderr, flush=True)
    print(f"[{label}] {len(failures)} failures", flush=True)
    directory = os.environ.get("SMP_TEST_REPORTS")
    if directory:
        path = os.path.join(directory, f"rank{rank}.json")
        with open(path + ".tmp", "w") as file:
            json.dump({"rank": int(rank), "failures": [f"{label}: {failure}" for failure in failures]}, file)
        os.replace(path + ".tmp", path)
    return 1 if failures else 0


def expect_error(failures, what, error_type, needle, action):
    """Runs `action`, which must raise `error_type` with `needle` in its message; else appends why to `failures`."""
    try:
        action()
    except error_type as error:
        if needle not in str(error):
            failures.append(f"{what}: {error_type.__name__} without {needle!r}: {error}")
        return
    except Exception as error:  # noqa: BLE001 - the wrong type is the failure reported
        failures.append(f"{what}: raised {type(error).__name__} ({error}), expected {error_type.__name__}")
        return
    failures.append(f"{what}: no error, expected {error_type.__name__}")
