"""`python -m loader`: see loader/cli.py."""

import sys

from dataset_format import extras


def main() -> int:
    from loader.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(extras.run_main(main, "python -m loader", "train"))
