"""The C parts of the loader: loader/format/_riegeli.c (ArrayRecord chunks read with the GIL released),
loader/planning/_pack.c (the packer of token rows) and loader/decoding/_jpeg.c (JPEG crop decode with libjpeg; optional:
without libjpeg's headers it is skipped and images decode through simplejpeg). Everything else is in pyproject.toml.
Images that copy only the conversion (dataflow/Dockerfile) have no loader/ and build nothing."""

from pathlib import Path

from setuptools import Extension, setup

LOADER = Path(__file__).parent / "loader"
FLAGS = ["-O3", "-std=gnu11"]

setup(ext_modules=[
    Extension("loader.format._riegeli", ["loader/format/_riegeli.c"], extra_compile_args=FLAGS, libraries=["dl"]),
    Extension("loader.planning._pack", ["loader/planning/_pack.c"], extra_compile_args=FLAGS),
    Extension("loader.decoding._jpeg", ["loader/decoding/_jpeg.c"], extra_compile_args=FLAGS, libraries=["jpeg"],
              optional=True),
] if LOADER.exists() else [])
