"""The fuzz suite: the committed corpus of crafted files (tests/loader/corpus.py), bounded mutation runs of shards
(tests/loader/fuzz.py) and of pre-tokenized token counts (tests/loader/fuzz_counts.py) in the default suite, and long
ones marked slow. Every case loads in a child process: a crash is a finding,
not a dead test run. Run it under AddressSanitizer and UBSan with scripts/sanitize.sh."""

import gzip
import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.loader import corpus, fuzz, fuzz_counts

CORPUS = sorted(json.loads((corpus.DIRECTORY / corpus.EXPECTED).read_text()).items())

# Cases a run gets: ~120 a second with 2 jobs on 2 cores, so the default suite's run takes ~10 s.
BOUNDED_CASES = 1000
LONG_CASES = 20_000


def _load_in_child(directory, check_hashes: bool) -> str:
    code = f"""
import hashlib, loader
try:
    got = [r for b in loader.load({str(directory / "*.array_record")!r}, batch_size=7, shuffle=False, num_epochs=1,
                                  decode=None, drop_remainder=False, check_hashes={check_hashes}) for r in b]
    print("RECORDS", len(got), hashlib.sha256(b"".join(got)).hexdigest())
except Exception as e:
    print("ERROR", type(e).__name__ + ":", e)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO))
    assert result.returncode == 0, f"the child died (return code {result.returncode}): {result.stderr[-2000:]}"
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("name, expected", CORPUS, ids=[name for name, _ in CORPUS])
def test_each_crafted_file_gives_what_it_must(tmp_path, name, expected):
    data = gzip.decompress((corpus.DIRECTORY / f"{name}.array_record.gz").read_bytes())
    (tmp_path / f"{name}.array_record").write_bytes(data)
    verdict = _load_in_child(tmp_path, expected["check_hashes"])
    if "error" in expected:
        assert verdict.startswith(("ERROR ValueError:", "ERROR OSError:")), verdict
        assert f"{name}.array_record" in verdict and expected["error"] in verdict, verdict
    else:
        assert verdict == f"RECORDS {expected['records']} {expected['sha256']}"


def test_the_corpus_is_what_its_generator_makes(tmp_path):
    """The committed files are corpus.build()'s (a changed generator means: regenerate, python -m tests.loader.corpus)."""
    built = corpus.build(tmp_path)
    assert sorted(built) == [name for name, _ in CORPUS]
    for name, (data, expectation) in built.items():
        committed = gzip.decompress((corpus.DIRECTORY / f"{name}.array_record.gz").read_bytes())
        assert hashlib.sha256(committed).digest() == hashlib.sha256(bytes(data)).digest(), name
        assert dict(CORPUS)[name] == expectation


def _assert_clean(report: dict, cases: int) -> None:
    counts = report["counts"]
    assert report["findings"] == [], report["findings"][:10]
    assert counts.get("records", 0) + counts.get("error", 0) == cases, counts
    # the mutations reach both outcomes and every kind
    assert counts.get("records", 0) > 0 and counts.get("error", 0) > 0
    assert set(report["kinds"]) == set(fuzz.KINDS)


def test_a_bounded_mutation_run_finds_nothing():
    report = fuzz.run(range(BOUNDED_CASES), seed=1, jobs=2)
    _assert_clean(report, BOUNDED_CASES)


@pytest.mark.slow
def test_a_long_mutation_run_finds_nothing():
    report = fuzz.run(range(LONG_CASES), seed=2, jobs=2)
    _assert_clean(report, LONG_CASES)


def test_the_fuzzer_would_see_a_crash(tmp_path):
    """The judge itself: a child that dies of a signal mid-case is a crash finding, named by its case."""
    worker = fuzz._Worker(tmp_path, 0, fuzz.KINDS, [7], 30, env=None)
    worker.proc.kill()  # as a SIGSEGV would
    worker.current = 7
    results = []
    while not worker.finished:
        results += worker.poll()
    assert [(r["case"], r["outcome"]) for r in results] == [(7, "crash")]


@pytest.fixture(scope="module")
def counts_seed(tmp_path_factory):
    return fuzz_counts.build(tmp_path_factory.mktemp("fuzz-counts"))


def _assert_counts_clean(report: dict, cases: int) -> None:
    counts = report["counts"]
    assert report["findings"] == [], report["findings"][:10]
    assert counts.get("rows", 0) + counts.get("error", 0) == cases, counts
    assert counts.get("rows", 0) > 0 and counts.get("error", 0) > 0
    assert set(report["kinds"]) == set(fuzz_counts.KINDS)


def test_a_bounded_counts_mutation_run_finds_nothing(counts_seed):
    """Damaged token counts: each case packs a whole epoch and checks every row's tokens against the records."""
    _assert_counts_clean(fuzz_counts.run(range(150), seed=1, seed_dir=counts_seed), 150)


@pytest.mark.slow
def test_a_long_counts_mutation_run_finds_nothing(counts_seed):
    _assert_counts_clean(fuzz_counts.run(range(3000), seed=2, seed_dir=counts_seed), 3000)
