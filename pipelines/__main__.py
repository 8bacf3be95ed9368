"""`python -m pipelines`: see pipelines/cli.py."""

import sys

from dataset_format import extras


def main() -> int:
    from pipelines.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(extras.run_main(main, "python -m pipelines", "convert"))
