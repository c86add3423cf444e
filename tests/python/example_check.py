"""Runs examples/python/hybrid_2x4.py as the 2x4 job (8 processes) and as one process on the same global batches,
and checks that both print the same losses, training and validation (within 1e-4), and the same validation accuracy:
pipeline and replicas change nothing but speed.

  example_check.py SMPRUN PYTHON EXAMPLE CONFIG
"""

import json
import os
import re
import subprocess
import sys
import tempfile

STEPS = 3


def losses(smprun, processes, python, example, config):
    command = [smprun, "-n", str(processes), "--timeout", "200", "--", python, example, "--config", config,
               "--steps", str(STEPS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    found = [float(value) for value in re.findall(r"\[rank 0\] step \d+ loss ([0-9.eE+-]+)", result.stdout)]
    found += [float(value) for value in re.findall(r"\[rank 0\] validation loss ([0-9.eE+-]+)", result.stdout)]
    found += [float(value) for value in
              re.findall(r"\[rank 0\] validation next-byte accuracy ([0-9.eE+-]+)", result.stdout)]
    if result.returncode != 0 or len(found) != STEPS + 2:
        print(result.stdout[-4000:], result.stderr[-4000:], sep="\n")
        raise SystemExit(f"{processes} processes: exit status {result.returncode}, {len(found)} loss lines")
    return found


def main():
    smprun, python, example, config = sys.argv[1:5]
    with open(config) as file:
        document = json.load(file)
    document["smp"].update({"partitions": 1, "microbatches": 1, "ddp": False})
    with tempfile.TemporaryDirectory() as directory:
        single_config = os.path.join(directory, "single.json")
        with open(single_config, "w") as file:
            json.dump(document, file)
        single = losses(smprun, 1, python, example, single_config)
    hybrid = losses(smprun, 8, python, example, config)
    print("one process:", single)
    print("2 x 4:      ", hybrid)
    for step, (a, b) in enumerate(zip(single[:-1], hybrid[:-1])):
        if abs(a - b) > 1e-4 * max(1.0, abs(a)):
            what = f"step {step}" if step < STEPS else "validation"
            raise SystemExit(f"{what}: loss {b} under 2 x 4, {a} in one process")
    # The accuracy counted from the outputs of the last stages' ranks; a guess flipping between near-equal logits
    # moves it by 1 / 4096.
    if abs(single[-1] - hybrid[-1]) > 2e-3 or single[-1] <= 0:
        raise SystemExit(f"validation accuracy {hybrid[-1]} under 2 x 4, {single[-1]} in one process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
