"""The command line: ``python -m ddp.bench`` (overlap and memory of our DDP against torch's), or
``python -m ddp.bench --sync ...`` (the communication-efficient methods against DDP)."""

import sys

from ddp.bench import overlap, sync

if __name__ == "__main__":
    # Communication-efficient methods against DDP: a table of their own (ddp/bench/sync.py).
    (sync if "--sync" in sys.argv[1:] else overlap).main()
