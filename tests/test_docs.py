"""The docs cannot drift from the code: their links resolve, their settings tables list every setting, and every
command or Python block runs (in a scratch directory holding the data the docs name: `data/train-*`, `data/test-*`,
`out/train`, `out/test`, `~/tensorflow_datasets/...`, buckets in the GCS emulator), or is marked
`<!-- docs-test: skip (why) -->` for a reason the test accepts (Google Cloud, an accelerator, a benchmark)."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, built_once

PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md")),
         REPO / "dataflow" / "README.md"]


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    broken = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert not broken, f"{page.relative_to(REPO)} links to missing files: {broken}"
    # links to a heading (page.md#heading, or #heading on this page) name one that is there
    anchored = [(link, anchor) for link, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text())
                if "://" not in link and (page.parent / link).suffix in (".md", "")]
    missing = [f"{link}#{anchor}" for link, anchor in anchored
               if anchor not in heading_anchors(page.parent / link if link else page)]
    assert not missing, f"{page.relative_to(REPO)} links to headings that are not there: {missing}"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens; a repeated one
    gets -1, -2, ..."""
    anchors, seen = set(), {}
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a comment in a code block is no heading
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if not count else f"{anchor}-{count}")
    return anchors


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


def test_the_code_layout_table_names_every_module():
    """docs/index.md's "Layout of the code" row of each package names each of its modules (and C sources)."""
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)/` \| (.*) \|$", (REPO / "docs" / "index.md")
                                                          .read_text(), flags=re.M)}
    missing = []
    for package in ("dataset_format", "pipelines", "loader", "trainer"):
        for path in sorted((REPO / package).rglob("*")):
            if path.suffix in (".py", ".c") and path.stem not in ("__init__", "__main__") \
                    and "datasets" not in path.parts and f"`{path.name}`" not in rows[package]:
                missing.append(str(path.relative_to(REPO)))
    assert not missing, f"docs/index.md's layout table does not name {missing}"


def test_no_page_narrates_the_projects_development():
    words = re.compile(r"\b((?<!Ray's )session|this VM|FIELD-NOTES|issue \d+|(?:commit|revision) [0-9a-f]{7}|"
                       r"an hour earlier|dev machine|before \w+ became the default|previous (?:reader|revision|version)|"
                       r"used to \w+|git history|earlier figures)\b|--previous [0-9a-f]{7,}\b|\b[0-9a-f]{7}\)", re.I)
    found = [(page.relative_to(REPO), m.group(0)) for page in PAGES if page.name != "CHANGELOG.md"
             for m in words.finditer(page.read_text())]
    assert not found, found




SKIP_REASONS = ("needs Google Cloud", "needs an accelerator VM", "needs several accelerator hosts",
                "needs gcsfuse and a bucket", "needs a Ray cluster of several machines",
                "a benchmark: minutes to hours; tests/test_docs.py checks its flags",
                "a fuzzing campaign: minutes; tests/test_docs.py checks its flags",
                "builds a virtual environment per install: 3 minutes with a warm pip cache",
                "the two commands: CI runs scripts/test.sh; scripts/demo.sh checks its own result")
BLOCK = re.compile(r"(?:<!-- docs-test: skip \(([^)]*)\) -->\n)?```(bash|python)\n(.*?)```", re.S)


def doc_blocks() -> list[tuple[str, int, str, str, str | None]]:
    """(page, n, language, code, skip reason) of every bash and Python block of the docs."""
    out = []
    for page in PAGES:
        for n, m in enumerate(BLOCK.finditer(page.read_text())):
            out.append((str(page.relative_to(REPO)), n, m.group(2), m.group(3), m.group(1)))
    return out


BLOCKS = doc_blocks()
RUN = [b for b in BLOCKS if b[4] is None]
SLOW = ("parameter_server", "resnet18", "resnet50", "make-demo")  # blocks that train a ResNet, start Ray, build data


def test_every_block_runs_or_says_why_it_cannot():
    odd = [(page, n, why) for page, n, _, _, why in BLOCKS if why is not None and why not in SKIP_REASONS]
    assert not odd, f"skipped for reasons the test does not accept: {odd}"
    assert len(RUN) >= 10, [b[:2] for b in RUN]


def test_each_benchmark_command_uses_flags_its_script_has():
    """Benchmarks (benchmarks/*.py) and the fuzzers (python -m tests.loader.fuzz, tests.loader.fuzz_counts)."""
    for page, n, _, code, _ in BLOCKS:
        for line in code.splitlines():
            script = re.search(r"(benchmarks/\w+\.py|-m tests\.loader\.fuzz\w*)", line)
            if script is None:
                continue
            name = script.group(1)
            path = f"tests/loader/{name.split('.')[-1]}.py" if name.startswith("-m") else name
            source = (REPO / path).read_text()
            for flag in re.findall(r"\s(--[\w-]+)", line.split("#")[0]):
                assert f'"{flag}"' in source, f"{page} block {n}: {script.group(1)} has no flag {flag}"


@pytest.fixture(scope="module")
def doc_world(tmp_path_factory, tfds_digits, gcs_emulator):
    """What the docs' examples name, built once: digits as `data/train-*` and `data/test-*` (ImageNet's shard names) and
    `data/exported/*.tfrecord-*` (one split, a directory input), converted as `out/train`, `out/test` (and
    `demo_out/array_record/custom/...`); the digits in ImageNet's layout as `/mnt/imagenet` (`make-demo --kind
    imagenet`), converted as `/mnt/imagenet-ar/{train,validation}`; a TFDS build under
    `~/tensorflow_datasets/mnist/3.0.1`; and in the emulator the buckets `my-bucket` and `bucket` (with `gs://bucket/ds`
    and `gs://bucket/digits/train`). (`/mnt/` is the scratch directory's `mnt/`.)"""
    from google.cloud import storage as gcs

    root = built_once(tmp_path_factory, "docs_world", lambda directory: _doc_files(directory, tfds_digits))
    client = gcs.Client()  # (the emulator is this worker's own)
    for name in ("my-bucket", "bucket"):
        bucket = client.create_bucket(name)
    for prefix in ("ds", "digits/train"):
        for path in (root / "out" / "train").iterdir():
            if path.is_file():
                bucket.blob(f"{prefix}/{path.name}").upload_from_filename(str(path))
    return root


def _doc_files(root: Path, tfds_digits: Path) -> Path:
    """The doc world's files (doc_world)."""
    from pipelines import ConvertConfig, run_conversion
    from pipelines.demo import write_digits_jpeg_tfrecords, write_digits_tfrecords

    write_digits_tfrecords(str(root / "raw"), num_shards=2)
    (root / "data" / "exported").mkdir(parents=True)
    for i, shard in enumerate(sorted((root / "raw").glob("digits-train.tfrecord-*"))):
        shutil.copy(shard, root / "data" / f"train-{i:05d}-of-00002")
        shutil.copy(shard, root / "data" / "exported" / shard.name)
    for i, shard in enumerate(sorted((root / "raw").glob("digits-test.tfrecord-*"))):
        shutil.copy(shard, root / "data" / f"test-{i:05d}-of-00002")
    for split in ("train", "test"):
        assert run_conversion(ConvertConfig(input=str(root / "raw" / f"digits-{split}.tfrecord-*"),
                                            output=str(root / "out" / split)), ["--direct_num_workers=1"]).ok
    write_digits_jpeg_tfrecords(str(root / "mnt" / "imagenet"), num_shards=2, imagenet_files=True)
    for split in ("train", "validation"):
        assert run_conversion(ConvertConfig(input=str(root / "mnt" / "imagenet" / f"{split}-*"),
                                            output=str(root / "mnt" / "imagenet-ar" / split)),
                              ["--direct_num_workers=1"]).ok
    (root / "demo_out" / "array_record").mkdir(parents=True)
    (root / "demo_out" / "array_record" / "custom").symlink_to(Path("..", "..", "out"))  # (a sandbox's own out/)
    (root / "tensorflow_datasets" / "mnist").mkdir(parents=True)
    (root / "tensorflow_datasets" / "mnist" / "3.0.1").symlink_to(tfds_digits)
    return root


def _sandbox(world: Path, tmp_path: Path) -> Path:
    """A scratch copy of the doc world (the examples write into it)."""
    box = tmp_path / "box"
    shutil.copytree(world, box, symlinks=True)
    return box


def _runnable(code: str, language: str) -> str:
    """The block as the test runs it: the checkout's interpreter for `python` and `.venv/bin/python`, installs
    dropped (the test's environment has every extra), /tmp/ and /mnt/ inside the scratch directory, a few steps."""
    code = re.sub(r"^\s*(\.venv/bin/)?pip install .*$", "", code, flags=re.M)
    code = code.replace(".venv/bin/python", "python").replace("/tmp/", "./tmp/").replace("/mnt/", "./mnt/")
    code = re.sub(r"\bsteps=\d+", "steps=2", code)
    return code  # `python` is the checkout's: its directory leads PATH


@pytest.mark.parametrize("page, n, language, code", [
    pytest.param(page, n, language, code, id=f"{page}:{n}",
                 marks=[pytest.mark.slow] if any(word in code for word in SLOW) else [])
    for page, n, language, code, _ in RUN])
def test_doc_block_runs(doc_world, gcs_emulator, tmp_path, page, n, language, code):
    box = _sandbox(doc_world, tmp_path)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}, **gcs_emulator,
           "HOME": str(box), "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    runnable = _runnable(code, language)
    if language == "python":
        runnable = ("import loader\n" if "import loader" not in runnable else "") + runnable
        cmd = [sys.executable, "-c", runnable]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", runnable]
    proc = subprocess.run(cmd, cwd=box, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{page} block {n}:\n{runnable}\n--- stderr:\n{proc.stderr[-3000:]}"
