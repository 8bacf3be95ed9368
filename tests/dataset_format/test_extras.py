"""A command run on an install without its extra says which extra to install, in one line (exit 2)."""

import subprocess
import sys

import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from dataset_format import extras
from tests.conftest import REPO


def _without(module: str, package: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m package args` with `module` unimportable, as on an install without the extra that brings it."""
    code = (f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = [{package!r}, *sys.argv[1:]]; "
            f"runpy.run_module({package!r}, run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("package, module, extra", [("trainer", "jax", "train"), ("loader", "grain", "train"),
                                                    ("pipelines", "apache_beam", "convert")])
def test_each_command_names_the_extra_it_lacks(tmp_path, package, module, extra):
    writer = ArrayRecordWriter(str(tmp_path / "data-0.array_record"), "group_size:1")
    writer.write(b"a record")
    writer.close()
    args = {"trainer": [f"data={tmp_path}/data-0.array_record", f"workdir={tmp_path}/run", "steps=1"],
            "loader": ["bench", f"{tmp_path}/data-0.array_record"],
            "pipelines": ["convert", "--input", f"{tmp_path}/in/*", "--output", f"{tmp_path}/out"]}[package]
    proc = _without(module, package, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: python -m {package} needs {module}, which this install lacks: install the project with its {extra} "
        f"extra, pip install \".[{extra}]\"")


def test_a_module_no_extra_brings_is_not_blamed_on_an_extra():
    assert extras.missing_extra(ModuleNotFoundError("x", name="mypackage.models"), "train") is None
    assert extras.missing_extra(ModuleNotFoundError("x", name="ray"), "train") == "ps"
    assert extras.missing_extra(ModuleNotFoundError("x", name="tokenizers"), "convert") == "convert"
    assert extras.missing_extra(ModuleNotFoundError("x", name="sklearn.datasets"), "convert") == "demo"
