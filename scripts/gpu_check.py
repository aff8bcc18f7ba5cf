#!/usr/bin/env python3
"""python scripts/gpu_check.py [--dry-run] [--only NAME ...] [--log-dir DIR]

The GPU checks of commlib in one run, one line per check and a final ``N passed, N failed``
(run through scripts/gpu_check.sh, which installs carried wheels first). Exit status: 0 all
passed, 1 a check failed, 2 no GPU here (nothing else was run). ``--dry-run`` probes the
environment and prints the commands without running them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mpi"
TOTAL_SECONDS = 450  # gpu_check.sh allows 470: leave time for the summary

# name, ranks, script, args, timeout (s), what it shows
CHECKS = [
    ("nccl_1rank", 1, "gpu_collectives_ranks.py", ["nccl"], 110,
     "single-rank NCCL: every op x dtype x size vs torch, NCCL natives + self send/recv"),
    ("staged_2", 2, "gpu_collectives_ranks.py", ["host_staged"], 100, "host-staged transport, 2 ranks on one GPU"),
    ("staged_4", 4, "gpu_collectives_ranks.py", ["host_staged"], 130, "host-staged transport, 4 ranks on one GPU"),
    ("ddp_cuda_2", 2, "gpu_ddp_ranks.py", ["host_staged"], 60, "DDP equivalence on CUDA tensors, 2 ranks"),
    ("overlap", 1, "gpu_overlap_ranks.py", ["nccl"], 45, "comm stream overlaps compute; ordering; watchdog"),
    ("duplicate_gpu", 2, "gpu_duplicate_ranks.py", [], 40, "two NCCL ranks on one GPU: our preflight error"),
]


def line(status: str, name: str, text: str) -> None:
    print(f"{status:<5} {name:<14} {text}", flush=True)


def find_mpiexec():
    candidates = [shutil.which("mpiexec"), str(Path(sys.executable).parent / "mpiexec"),
                  "/tmp/site-prefix/bin/mpiexec", "/tmp/site-prefix/local/bin/mpiexec",
                  "/tmp/site/bin/mpiexec"]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def probe():
    """(gpu_ok, mpi_ok, text): versions of everything involved; never raises."""
    parts = [f"python {sys.version.split()[0]}"]
    gpu_ok, mpi_ok = False, False
    try:
        import torch

        cuda = torch.cuda.is_available()
        parts.append(f"torch {torch.__version__} cuda={cuda}")
        if cuda:
            parts.append(f"gpu '{torch.cuda.get_device_name(0)}' x{torch.cuda.device_count()}")
            try:
                parts.append(f"torch-nccl {'.'.join(map(str, torch.cuda.nccl.version()))}")
            except Exception:  # noqa: BLE001 - an optional detail of the environment line
                pass
    except Exception as exc:  # noqa: BLE001 - reported in the environment line; the checks still run
        parts.append(f"torch missing ({exc.__class__.__name__}: {exc})")
    try:
        import cupy

        parts.append(f"cupy {cupy.__version__}")
        count = cupy.cuda.runtime.getDeviceCount()
        gpu_ok = count > 0
        runtime = cupy.cuda.runtime
        parts.append(f"cuda runtime {runtime.runtimeGetVersion()} driver {runtime.driverGetVersion()}")
        try:
            from cupy.cuda import nccl

            from commlib.gpu.preflight import format_nccl_version

            parts.append(f"nccl {format_nccl_version(nccl.get_version())}")
        except Exception as exc:  # noqa: BLE001 - reported in the environment line
            parts.append(f"nccl unavailable ({exc})")
    except Exception as exc:  # noqa: BLE001 - no GPU is a finding to report, not a crash
        parts.append(f"no GPU: {exc.__class__.__name__}: {exc}")
    try:
        import mpi4py

        parts.append(f"mpi4py {mpi4py.__version__}")
        from mpi4py import MPI

        parts.append(f"MPI '{MPI.Get_library_version().splitlines()[0].strip()[:40]}'")
        mpi_ok = True
    except Exception as exc:  # noqa: BLE001 - reported in the environment line
        parts.append(f"no MPI library ({exc.__class__.__name__}: {exc}); carry the mpich wheel in .whl/")
    mpiexec = find_mpiexec()
    parts.append(f"mpiexec {mpiexec or 'NOT FOUND'}")
    return gpu_ok, mpi_ok, ", ".join(parts)


def command_for(ranks, script, args, mpiexec):
    script_path = str(SCRIPTS / script)
    if mpiexec is None:
        if ranks != 1:
            return None
        return [sys.executable, script_path, *args]  # MPI singleton: one rank needs no launcher
    return [mpiexec, "-n", str(ranks), sys.executable, script_path, *args]


def run_check(command, timeout, log_path):
    env = dict(os.environ)
    # The rank scripts import tests.support; line_buffered makes every rank write whole lines.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "support" / "line_buffered"), str(ROOT),
                                                      env.get("PYTHONPATH", "")]))
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                # We only hand host buffers to MPI: keep MPICH's own GPU support out of the way.
                "MPIR_CVAR_ENABLE_GPU": "0",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               cwd=str(ROOT), start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        rc = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        rc = None
    elapsed = time.monotonic() - start
    if log_path is not None:
        Path(log_path).write_text(output)
    return rc, elapsed, output


def summary_of(output: str, rc) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    if rc == 0:
        interesting = [line for line in lines
                       if line.startswith(("OK:", "overlap", "ordering", "watchdog", "error:", "spin"))]
        return " | ".join(interesting[-4:]) or (lines[-1] if lines else "")
    failed = [line for line in lines if "FAILED" in line or "Error" in line or "rank " in line]
    return " | ".join((failed or lines)[-4:])[:800]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="probe, print the commands, run nothing")
    parser.add_argument("--only", nargs="*", help="run only these checks")
    parser.add_argument("--log-dir", default=os.environ.get("OUT"), help="write each check's full output here")
    options = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    started = time.monotonic()

    gpu_ok, mpi_ok, text = probe()
    line("PASS" if gpu_ok and mpi_ok else "FAIL", "env", text)
    passed, failed, skipped = (1, 0, 0) if gpu_ok and mpi_ok else (0, 1, 0)
    checks = [c for c in CHECKS if not options.only or c[0] in options.only]
    mpiexec = find_mpiexec()

    if not gpu_ok and not options.dry_run:
        for name, *_ in checks:
            line("SKIP", name, "no GPU")
        print(f"{passed} passed, {failed} failed, {len(checks)} skipped: no GPU on this machine", flush=True)
        return 2

    for name, ranks, script, args, timeout, what in checks:
        command = command_for(ranks, script, args, mpiexec if mpi_ok else None)
        if command is None or not mpi_ok:
            why = "no MPI library for mpi4py" if not mpi_ok else f"needs mpiexec for {ranks} ranks; none found"
            line("FAIL", name, f"{what}: {why}")
            failed += 1
            continue
        if options.dry_run:
            line("DRY", name, " ".join(command))
            skipped += 1
            continue
        left = TOTAL_SECONDS - (time.monotonic() - started)
        if left < 10:
            line("FAIL", name, "not run: the whole check ran out of its time budget")
            failed += 1
            continue
        log_path = Path(options.log_dir) / f"gpu_check_{name}.log" if options.log_dir else None
        rc, elapsed, output = run_check(command, min(timeout, left), log_path)
        status = "PASS" if rc == 0 else "FAIL"
        detail = "timed out" if rc is None else f"rc={rc}"
        line(status, name, f"{what} ({elapsed:.1f} s, {detail}): {summary_of(output, rc)}")
        passed, failed = passed + (rc == 0), failed + (rc != 0)

    tail = f", {skipped} not run (dry run)" if options.dry_run else ""
    print(f"{passed} passed, {failed} failed{tail}", flush=True)
    if not gpu_ok:
        return 2
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
