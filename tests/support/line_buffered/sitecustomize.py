"""Every Python process the tests start writes its stdout and stderr one whole line per write.

Python's site module imports ``sitecustomize`` at start-up from the first directory on the path
that has one; the tests put this directory first on ``PYTHONPATH`` for everything they launch
(``tests.support.mpirun.child_environment``), so every rank script, example, ``python -m ...``
tool and subprocess of theirs runs this before its own first line.

Why: mpiexec forwards each rank's output in the pieces the rank wrote it. Unbuffered, as
``PYTHONUNBUFFERED=1`` makes it (and it must stay unbuffered: a rank killed on purpose must
not lose its last lines), ``print(line)`` is two writes, the text and then its newline, and a
line of another rank can land between them: two ranks' lines joined on one line, the newline on
the next (the ``p2p_peer_exit`` failures of issue 24). Line-buffered, the text and its newline
leave in one write, as soon as the newline is written.
"""

import faulthandler
import signal
import sys

for _stream in (sys.stdout, sys.stderr):
    if _stream is not None and hasattr(_stream, "reconfigure"):
        _stream.reconfigure(line_buffering=True, write_through=False)

# A hung job is killed by the tests (tests/support/processes.py, kill_tree); just before, they send
# SIGUSR1, and every Python process of the job writes where each of its threads is. A process
# that crashes (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) writes the same before it dies: a
# "Segmentation fault (signal 11)" from mpiexec alone says nothing of where.
if sys.stderr is not None:
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable(all_threads=True)
