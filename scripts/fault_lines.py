"""python scripts/fault_lines.py [--runs 50] [--nprocs 3] [--modes exception,exit,...]

Runs every fault mode of tests/mpi/reliability_faults_ranks.py N times under mpiexec and counts the runs whose
output carries the line that names the cause (which rank failed, how, in which collective).
A measurement, not a test (it takes minutes): the reliability issue asks for 50 of 50 per mode.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.fault_causes import CAUSE_LINES as CAUSE  # noqa: E402

TIMEOUT = "2.0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--nprocs", type=int, default=3)
    parser.add_argument("--modes", default=",".join(CAUSE))
    args = parser.parse_args()
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests' / 'support' / 'line_buffered'}:{ROOT}", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    print("| mode | runs | cause line present | non-zero exit | ranks that said why, median (min) | median s "
          "| example |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for mode in args.modes.split(","):
        present = failed = 0
        times, example, misses, reporters = [], "", [], []
        for _ in range(args.runs):
            started = time.monotonic()
            result = subprocess.run([mpiexec, "-n", str(args.nprocs), sys.executable,
                                     str(ROOT / "tests" / "mpi" / "reliability_faults_ranks.py"), mode, TIMEOUT],
                                    capture_output=True, text=True, env=env, timeout=120)
            times.append(time.monotonic() - started)
            output = result.stdout + result.stderr
            match = re.search(CAUSE[mode], output)
            failed += result.returncode != 0
            # How many ranks got their own line out before the teardown (an aborting rank may
            # kill a peer that is writing its line at the same moment).
            reporters.append(len(set(re.findall(r"commlib: rank (\d+)/\d+ on \S+ failed", output))))
            if match:
                present += 1
                example = example or output[output.rfind("\n", 0, match.start()) + 1:match.end()]
            else:
                misses.append(output)
        times.sort()
        reporters.sort()
        print(f"| {mode} | {args.runs} | {present} | {failed} | {reporters[len(reporters) // 2]} "
              f"({reporters[0]}) | {times[len(times) // 2]:.2f} | "
              f"`{example[:160]}` |", flush=True)
        for miss in misses[:2]:
            print(f"--- a run of {mode} without the cause line:\n{miss[-3000:]}", file=sys.stderr)


if __name__ == "__main__":
    main()
