"""Which extra of the install brings a module, so that a command run where its extra is missing says the one line that
fixes it. `pip install .` (the base) installs every package of the project, but only `dataset_format`'s dependencies:
`python -m pipelines` needs `.[convert]`, `python -m loader` and `python -m trainer` need `.[train]`.

    sys.exit(extras.run_main(main, "python -m trainer", "train"))
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# The top-level modules each extra brings (pyproject.toml's [project.optional-dependencies]).
MODULES = {
    "convert": ("apache_beam", "array_record", "tensorflow_datasets", "tensorflow", "sentencepiece", "tokenizers",
                "mlcroissant", "build"),
    "train": ("grain", "jax", "jaxlib", "flax", "optax", "orbax", "tensorboardX", "aiohttp", "gcsfs",
              "array_record", "tensorflow_datasets", "simplejpeg", "cv2", "sentencepiece", "tokenizers", "yaml"),
    "ps": ("ray",),
    "demo": ("sklearn", "PIL"),
}


def missing_extra(error: ModuleNotFoundError, wanted: str) -> str | None:
    """The extra that brings the module `error` misses (`wanted`, the command's own, where it brings it), or None for
    a module no extra brings (a bug or a broken install: its traceback tells more)."""
    module = (error.name or "").split(".")[0]
    extras = [extra for extra, modules in MODULES.items() if module in modules]
    if not extras:
        return None
    return wanted if wanted in extras else extras[0]


def run_main(main: Callable[[], int], program: str, extra: str) -> int:
    """main()'s exit status; a module missing that an extra brings ends it with one line naming the install (exit 2)."""
    try:
        return main()
    except ModuleNotFoundError as e:
        needed = missing_extra(e, extra)
        if needed is None:
            raise
        print(f"error: {program} needs {e.name.split('.')[0]}, which this install lacks: install the project with its "
              f"{needed} extra, pip install \".[{needed}]\"", file=sys.stderr)
        return 2
