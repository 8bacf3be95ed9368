"""Flex Template entry point (FLEX_TEMPLATE_PYTHON_PY_FILE): the launcher runs
`python main.py --input=gs://... --output=gs://... [--param=value ...] [Dataflow options]`: the `convert` command
line in this image (pipelines/dataflow.py `flex_template_argv`), the launch not waiting for the job."""

import os
import sys

from pipelines.cli import main
from pipelines.dataflow import flex_template_argv

if __name__ == "__main__":
    sys.exit(main(flex_template_argv(sys.argv[1:], dict(os.environ))))
