"""`python -m loader`: see loader/cli.py."""

import sys

from loader.cli import main

if __name__ == "__main__":
    sys.exit(main())
