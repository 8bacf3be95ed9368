"""`python -m trainer [--config FILE] key=value ...`: see trainer/config.py for the keys."""

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer", description="Train a JAX model on converted data.")
    p.add_argument("--config", help="a JSON file of config keys (command-line key=value pairs override it)")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. data=out/train steps=500 strategy=mirrored")
    args = p.parse_args(argv)
    from dataset_format import logs
    from trainer.config import TrainConfig

    logs.setup()
    try:
        config = TrainConfig.from_args(args.overrides, args.config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from trainer.launch import run

    try:
        summary = run(config)
    except (ValueError, FileNotFoundError) as e:  # bad data, strategy or hardware: say what, not where
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"summary": summary, "workdir": config.workdir}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
