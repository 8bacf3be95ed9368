"""`python -m pipelines`: see pipelines/cli.py."""

import sys

from pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main())
