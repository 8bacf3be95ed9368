"""The docs cannot drift from the code: their links resolve, their settings tables list every setting, and their
examples run (the README's, and loading.md's own-grain-pipeline example, on a converted dataset)."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md")),
         REPO / "dataflow" / "README.md"]


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    broken = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert not broken, f"{page.relative_to(REPO)} links to missing files: {broken}"


def table_keys(page: Path) -> set[str]:
    """The backquoted names in the first column of a page's tables."""
    keys = set()
    for line in page.read_text().splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            keys.update(re.findall(r"`(\w+)`", cells[1]))
    return keys


def test_the_training_settings_table_lists_every_setting():
    from trainer.config import TrainConfig

    missing = {f.name for f in dataclasses.fields(TrainConfig)} - table_keys(REPO / "docs" / "training.md")
    assert not missing, f"docs/training.md's settings table lacks {sorted(missing)}"


def test_the_loading_options_table_lists_every_option():
    from loader import LoaderConfig

    missing = {f.name for f in dataclasses.fields(LoaderConfig)} - table_keys(REPO / "docs" / "loading.md")
    assert not missing, f"docs/loading.md's options table lacks {sorted(missing)}"


def test_no_page_narrates_the_projects_development():
    words = re.compile(r"\b((?<!Ray's )session|this VM|FIELD-NOTES|issue \d+|commit [0-9a-f]{7})\b", re.I)
    found = [(page.relative_to(REPO), m.group(0)) for page in PAGES if page.name != "CHANGELOG.md"
             for m in words.finditer(page.read_text())]
    assert not found, found


@pytest.fixture(scope="module")
def converted_digits(tmp_path_factory):
    from pipelines.demo import write_digits_tfrecords

    root = tmp_path_factory.mktemp("docs")
    write_digits_tfrecords(str(root / "data"), num_shards=2)
    return root


def test_the_readme_examples_run(converted_digits, tmp_path):
    """The README's three examples, in order, with its paths (`data/train-*.tfrecord`, `out/train`) in a temporary
    directory and a short run."""
    shell = blocks(REPO / "README.md", "bash")
    convert = next(b for b in shell if "pipelines convert" in b).strip()
    train = next(b for b in shell if "python -m trainer" in b).strip()
    (tmp_path / "data").mkdir()
    for i, shard in enumerate(sorted((converted_digits / "data").glob("digits-train.tfrecord-*"))):
        (tmp_path / "data" / f"train-{i}.tfrecord").symlink_to(shard)
    for test in sorted((converted_digits / "data").glob("digits-test.tfrecord-*")):
        (tmp_path / "test").mkdir(exist_ok=True)
        (tmp_path / "test" / test.name).symlink_to(test)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    command = convert.split("#")[0].replace("python ", f"{sys.executable} ")
    proc = subprocess.run(command, shell=True, **run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run(f"{sys.executable} -m pipelines convert --input 'test/*' --output out/test", shell=True,
                          **run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = blocks(REPO / "README.md", "python")[0]
    proc = subprocess.run([sys.executable, "-c", code + "\nprint(sorted(batch), len(batch['label']), "
                                                        "state['next_batch'])"], **run)
    assert proc.returncode == 0 and proc.stdout.split() == ["['image',", "'label']", "256", "1"], proc.stderr[-2000:]
    command = train.replace("python ", f"{sys.executable} ").replace("steps=600", "steps=4 log_every=2") \
        .replace("workdir=/tmp/run", "workdir=run")
    proc = subprocess.run(command, shell=True, **run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [2, 4]


def test_loading_mds_own_grain_pipeline_example_runs(converted_digits, tmp_path):
    from pipelines import ConvertConfig, run_conversion

    out = tmp_path / "out" / "train"
    assert run_conversion(ConvertConfig(input=str(converted_digits / "data" / "digits-train.tfrecord-*"),
                                        output=str(out)), ["--direct_num_workers=1"]).ok
    code = next(b for b in blocks(REPO / "docs" / "loading.md", "python") if "ArrayRecordDataSource" in b)
    proc = subprocess.run([sys.executable, "-c", code + "\nfirst = ds[0]\nprint(len(first), sorted(first[0]))"],
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "256 ['image', 'label']"
