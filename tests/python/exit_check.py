"""Two processes sum a Python tensor with runtime.all_reduce_sum as their last act and exit at once, six times: each
job must end cleanly. Gloo once held the caller's tensor in a work object that a Gloo thread dropped after the call
returned; at interpreter exit that thread, waiting for the GIL to release the Python object, died inside a
destructor and aborted the process ("terminate called without an active exception", 9 of 20 such jobs).

  exit_check.py SMPRUN PYTHON
"""

import subprocess
import sys

JOBS = 6
SCRIPT = """
import torch, smp
runtime = smp.init({"smp": {"partitions": 1, "ddp": True, "device": "cpu"}})
values = torch.ones(3)
runtime.all_reduce_sum(values)
assert values.tolist() == [2.0, 2.0, 2.0], values
"""


def main():
    smprun, python = sys.argv[1:3]
    for job in range(JOBS):
        result = subprocess.run([smprun, "-n", "2", "--timeout", "60", "--", python, "-c", SCRIPT],
                                capture_output=True, text=True, timeout=90)
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:], sep="\n")
            raise SystemExit(f"job {job + 1} of {JOBS}: exit status {result.returncode}")
    print(f"{JOBS} jobs ended cleanly")


if __name__ == "__main__":
    main()
