"""Flex Template entry point (FLEX_TEMPLATE_PYTHON_PY_FILE): the launcher runs
`python main.py --input=gs://... --output=gs://... [--param=value ...] [Dataflow options]`."""

import sys

from pipelines.dataflow import flex_template_main

if __name__ == "__main__":
    sys.exit(flex_template_main())
