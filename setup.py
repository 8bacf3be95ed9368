"""The C part of the loader (loader/_riegeli.c: ArrayRecord chunks read with the GIL released). Everything else
is in pyproject.toml. Images that copy only the conversion (dataflow/Dockerfile) have no loader/ and build nothing."""

from pathlib import Path

from setuptools import Extension, setup

SOURCE = Path(__file__).parent / "loader" / "_riegeli.c"

setup(ext_modules=[Extension("loader._riegeli", ["loader/_riegeli.c"], extra_compile_args=["-O3", "-std=gnu11"],
                             libraries=["dl"])] if SOURCE.exists() else [])
