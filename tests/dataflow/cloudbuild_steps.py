"""Reading Cloud Build configs as Cloud Build does: substitutions (incl. dynamic ones), `$$` escapes,
and step scripts run with bash against a stand-in `gcloud` that records its arguments."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import yaml

# https://cloud.google.com/build/docs/configuring-builds/substitute-variable-values
BUILTINS = {"PROJECT_ID", "BUILD_ID", "PROJECT_NUMBER", "LOCATION", "TRIGGER_NAME", "COMMIT_SHA", "REVISION_ID",
            "SHORT_SHA", "REPO_NAME", "REPO_FULL_NAME", "BRANCH_NAME", "TAG_NAME", "REF_NAME",
            "TRIGGER_BUILD_CONFIG_PATH", "SERVICE_ACCOUNT_EMAIL", "SERVICE_ACCOUNT"}
_TOKEN = re.compile(r"\$\$|\$\{(\w+)\}|\$(\w+)|\$\{[^}]*\}?|\$")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def strings(node) -> list[str]:
    """Every string in the config (where Cloud Build substitutes)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return []


def references(text: str) -> tuple[set[str], list[str]]:
    """(names referenced, malformed `$` uses that Cloud Build would reject)."""
    names, bad = set(), []
    for m in _TOKEN.finditer(text):
        if m.group(0) == "$$":
            continue
        name = m.group(1) or m.group(2)
        if name:
            names.add(name)
        else:
            bad.append(text[m.start():m.start() + 20])
    return names, bad


def substitute(text: str, values: dict[str, str]) -> str:
    def one(m):
        if m.group(0) == "$$":
            return "$"
        return values[m.group(1) or m.group(2)]
    return _TOKEN.sub(one, text)


def resolve(config: dict, overrides: dict[str, str], builtins: dict[str, str]) -> dict[str, str]:
    """Substitution values as a build sees them: defaults, then overrides, then dynamic expansion."""
    values = {**builtins, **config.get("substitutions", {}), **overrides}
    for _ in range(5):  # derived values may name derived values
        values = {k: substitute(v, values) for k, v in values.items()}
    return values


def step(config: dict, step_id: str) -> dict:
    (found,) = [s for s in config["steps"] if s.get("id") == step_id]
    return found


def fake_gcloud(directory: Path) -> Path:
    """A `gcloud` on PATH that appends its arguments (one JSON list per call) to $GCLOUD_CALLS, and answers
    `dataflow jobs list --filter=name~REGEX` with the ids of the jobs in $GCLOUD_ACTIVE_JOBS ("id name" a line)
    whose name the regular expression finds (as gcloud's `~` does)."""
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "gcloud"
    exe.write_text("#!/usr/bin/env python3\nimport json, os, re, sys\n"
                   "with open(os.environ['GCLOUD_CALLS'], 'a') as f:\n"
                   "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
                   "if sys.argv[1:4] == ['dataflow', 'jobs', 'list']:\n"
                   "    pattern = next(a.split('name~', 1)[1] for a in sys.argv if a.startswith('--filter=name~'))\n"
                   "    for line in os.environ.get('GCLOUD_ACTIVE_JOBS', '').splitlines():\n"
                   "        job_id, name = line.split()\n"
                   "        if re.search(pattern, name):\n"
                   "            print(job_id)\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return directory


def run_bash_step(config: dict, step_id: str, values: dict[str, str], workspace: Path, active_jobs: str = ""):
    """Runs a `bash -c` step as Cloud Build would (cwd = the workspace); returns (process, gcloud calls).
    `active_jobs`: the active Dataflow jobs, "id name" a line."""
    s = step(config, step_id)
    assert s["entrypoint"] == "bash" and s["args"][0] == "-c", s
    script = substitute(s["args"][1], values)
    bin_dir = fake_gcloud(workspace / ".fake-bin")
    calls = workspace / ".gcloud-calls"
    calls.write_text("")
    proc = subprocess.run(["bash", "-c", script], cwd=workspace, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                               "GCLOUD_CALLS": str(calls), "GCLOUD_ACTIVE_JOBS": active_jobs})
    return proc, [json.loads(line) for line in calls.read_text().splitlines()]


def flag(call: list[str], name: str) -> str | None:
    for arg in call:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None
