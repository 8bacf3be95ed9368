"""`python -m pipelines`: see pipelines/cli.py."""

import os
import sys

from dataset_format import extras

STOPPED = (130, 143)  # Ctrl-C, SIGTERM (pipelines/cli.py)


def main() -> int:
    from pipelines.cli import main as cli

    code = cli(process=True)
    if code in STOPPED:
        # Stopped mid-run, its line said and its lease given back: Beam's in-process workers may still be running in
        # native threads, and the interpreter's teardown under them ended in "terminate called without an active
        # exception" (exit 134, not this status). What they were writing is a temporary file the next run removes.
        # The cleanups registered with atexit still run: a launch's staged worker project, Beam's subprocess workers.
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(extras.run_main(main, "python -m pipelines", "convert"))
