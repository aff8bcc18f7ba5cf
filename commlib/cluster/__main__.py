"""The command line: ``python -m commlib.cluster``."""

import sys

from commlib.cluster.cluster import main

if __name__ == "__main__":
    sys.exit(main())
