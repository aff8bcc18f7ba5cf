"""The command line: ``python -m commlib.bench``."""

import sys

from commlib.bench.harness import main

if __name__ == "__main__":
    sys.exit(main())
