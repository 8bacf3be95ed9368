"""dataflow/metadata.json declares exactly the conversion's CLI flags, with validation that agrees with
the CLI's, and the Flex Template entry point turns the launcher's `--param=value` flags into a run."""

import json
import re

import pytest

from pipelines import cli, config
from pipelines.dataflow import SDK_IMAGE_ENV, flex_template_argv
from tests.conftest import REPO

METADATA = json.loads((REPO / "dataflow" / "metadata.json").read_text())
PARAMS = {p["name"]: p for p in METADATA["parameters"]}


def _cli_flags():
    parser = cli._convert_parser()
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_parameters_match_the_cli_flags():
    flags = _cli_flags()
    assert set(PARAMS) == set(flags) - set(cli.LAUNCH_FLAGS)
    for name, action in flags.items():
        assert f"--{name}" in action.option_strings  # the launcher passes --name=value
        assert PARAMS[name]["isOptional"] is not action.required, name
        assert PARAMS[name]["label"] and PARAMS[name]["helpText"], name


@pytest.mark.parametrize("name", ["skip_corrupt", "prune", "force"])
def test_boolean_parameters_parse_as_the_launcher_passes_them(name):
    assert PARAMS[name]["regexes"] == ["^(true|false)$"]
    parser = cli._convert_parser()
    base = ["--input", "gs://b/in/*", "--output", "gs://b/out"]
    assert getattr(parser.parse_args(base + [f"--{name}=true"]), name) is True
    assert getattr(parser.parse_args(base + [f"--{name}=false"]), name) is False
    assert getattr(parser.parse_args(base + [f"--{name}"]), name) is True
    # unset: False, or for skip_corrupt "as the output's manifest says" (pipelines/plan.py recorded_options)
    assert getattr(parser.parse_args(base), name) is (None if name == "skip_corrupt" else False)
    with pytest.raises(SystemExit):
        parser.parse_args(base + [f"--{name}=maybe"])


def _accepts(name, value):
    return all(re.fullmatch(r, value) for r in PARAMS[name]["regexes"])


def test_validation_agrees_with_the_cli():
    assert PARAMS["compression"]["regexes"] == [config.COMPRESSION_NAME.pattern]
    assert _accepts("compression", config.DEFAULT_COMPRESSION) and not _accepts("compression", "lz4")
    assert _accepts("writer_options", "group_size:1,zstd:1") and not _accepts("writer_options", "zstd:1")
    assert not _accepts("writer_options", "group_size:64,zstd:1") and not _accepts("writer_options", "group_size:16")
    assert [_accepts("compression", c) for c in ("zstd:22", "zstd:-5", "brotli:11", "zstd:23", "brotli:12")] == [
        True, True, True, False, False]
    assert _accepts("input", "gs://b/raw/train-*.tfrecord") and not _accepts("input", "/data/train-*.tfrecord")
    assert _accepts("output", "gs://b/ar") and not _accepts("output", "out/")


def test_flex_template_argv_runs_convert_in_this_image_without_waiting():
    argv = flex_template_argv(["--input=gs://b/in/*", "--output=gs://b/out", "--prune=true",
                               "--runner=DataflowRunner"], {SDK_IMAGE_ENV: "img:abc"})
    assert argv[:2] == ["convert", "--no_wait"]
    assert argv[-2:] == ["--sdk_container_image=img:abc", "--sdk_location=container"]
    parser = cli._convert_parser()
    parser.add_argument("--no_wait", action="store_true")
    args, beam_args = parser.parse_known_args(argv[1:])
    assert (args.input, args.output, args.prune, args.no_wait) == ("gs://b/in/*", "gs://b/out", True, True)
    assert beam_args == ["--runner=DataflowRunner", "--sdk_container_image=img:abc", "--sdk_location=container"]
    # An image given at launch wins over the baked-in one.
    given = flex_template_argv(["--sdk_container_image=other"], {SDK_IMAGE_ENV: "img:abc"})
    assert given == ["convert", "--no_wait", "--sdk_container_image=other"]
