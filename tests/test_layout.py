"""The packages' layout: trainer -> loader -> dataset_format <- pipelines, read from every module's imports.

Imports inside functions count too (a lazy import still needs the package installed), so each side installs
only its own extra: a training host carries no Beam, a Dataflow worker no JAX.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_BEAM = {"apache_beam"}
_TRAINING = {"jax", "jaxlib", "flax", "optax", "orbax", "grain", "tensorboardX"}
_TENSORFLOW = {"tensorflow", "tensorflow_datasets", "keras"}
_OURS = {"dataset_format", "pipelines", "loader", "trainer"}

# package -> top-level modules it must never import
FORBIDDEN = {
    "dataset_format": _BEAM | _TRAINING | _TENSORFLOW | (_OURS - {"dataset_format"}) | {"array_record", "ray"},
    "pipelines": _TRAINING | {"loader", "trainer", "ray"},
    "loader": _BEAM | {"tensorflow", "keras", "pipelines", "trainer"},
    "trainer": _BEAM | {"tensorflow", "pipelines"},
}


def imported_modules(path: Path) -> dict[str, int]:
    """Top-level module name -> first line that imports it, for every import in the file (nested ones too)."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for module, line in imported_modules(path).items():
            if module in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_layout(package):
    assert violations(package) == []


def test_only_the_parameter_server_and_the_ray_executor_import_ray():
    """Ray is the `[ps]` extra: everything else in the trainer and the loader works without it."""
    users = sorted(str(path.relative_to(REPO)) for package in ("trainer", "loader")
                   for path in (REPO / package).rglob("*.py") if "ray" in imported_modules(path))
    assert users == ["loader/executors/ray_actors.py", "trainer/parameter_server.py"]


def test_a_forbidden_import_is_found_wherever_it_stands(tmp_path, monkeypatch):
    """The check itself: a lazy import inside a function, and a `from x.y import z`, are both caught."""
    package = tmp_path / "loader"
    package.mkdir()
    (package / "ok.py").write_text("import numpy\nfrom dataset_format import storage\n")
    (package / "bad.py").write_text("import os\n\n\ndef f():\n    from apache_beam.io import filesystems\n"
                                    "    import pipelines.convert\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["REPO"]), "REPO", tmp_path)
    assert violations("loader") == ["loader/bad.py:5 imports apache_beam", "loader/bad.py:6 imports pipelines"]


def test_the_dataset_format_package_needs_only_the_base_install():
    """Its imports are the standard library, numpy, protobuf, google-cloud-storage, and requests and google-crc32c
    (google-cloud-storage's own): pyproject's base list."""
    import sys

    allowed = set(sys.stdlib_module_names) | {"numpy", "google", "requests", "google_crc32c", "dataset_format"}
    used = set()
    for path in (REPO / "dataset_format").rglob("*.py"):
        if path.name == "tokenizer.py":  # its libraries are imported where used, by [convert] and [train] installs
            assert set(imported_modules(path)) - allowed == {"tokenizers", "sentencepiece"}
            continue
        used |= set(imported_modules(path))
    assert used - allowed == set()


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Our modules -> the modules of ours each imports (at the top or inside a function): `from pkg import name`
    counts as importing pkg.name where that is a module (C extensions included), else pkg itself."""
    modules: dict[str, Path | None] = {}
    for package in sorted(_OURS):
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
        for source in (root / package).rglob("_*.c"):  # C extensions: built next to their source
            modules.setdefault(".".join(source.relative_to(root).with_suffix("").parts), None)
    graph = {}
    for name, path in modules.items():
        targets: set[str] = set()
        if path is not None:
            here = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    targets |= {a.name for a in node.names if a.name in modules}
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = here.split(".")[:len(here.split(".")) - node.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        targets.add(full if full in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


def test_a_circle_is_found_through_a_lazy_import(tmp_path):
    """The check itself: a -> b at the top, b -> a inside a function; c stands apart."""
    package = tmp_path / "loader"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loader import b\n")
    (package / "b.py").write_text("def f():\n    from loader.a import g\n")
    (package / "c.py").write_text("from loader import _ext, a\n")
    (package / "_ext.c").write_text("")
    graph = import_graph(tmp_path)
    assert graph["loader.c"] == {"loader._ext", "loader.a"}
    assert circles(graph) == [["loader.a", "loader.b"]]


# loader/'s rooms, one layer each. A room imports itself and the rooms listed for it, nothing else of the loader; the
# package's own modules (loader/*.py: the loaders, the grain source, the CLI) put the rooms together, and no room
# imports them.
LOADER_ROOMS = {
    "format": set(),  # ArrayRecord files: the C reader, the index, what a dataset is
    "decoding": set(),  # records -> arrays: Examples, TFDS features, images
    "executors": set(),  # where groups are computed: threads, processes, Ray; placing batches on devices
    "fetch": {"format"},  # records' bytes: the batch reader, gs://, the chunk caches, staging
    "planning": {"format"},  # what each batch holds: permutation, batches, mixtures, packing, token counts
}


def room(module: str) -> str:
    """'loader.fetch.reader' -> 'fetch'; the package's own modules ('loader', 'loader.pipeline') -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LOADER_ROOMS else ""


def room_violations(root: Path = REPO) -> list[str]:
    graph = import_graph(root)
    bad = []
    for module, targets in sorted(graph.items()):
        here = room(module)
        if not module.startswith("loader.") or not here:
            continue
        for target in sorted(t for t in targets if t == "loader" or t.startswith("loader.")):
            there = room(target)
            if there != here and there not in LOADER_ROOMS[here]:
                bad.append(f"{module} ({here}) imports {target} ({there or 'the package'})")
    return bad


def test_loader_rooms_import_one_way():
    assert room_violations() == []
    rooms = {p.name for p in (REPO / "loader").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(LOADER_ROOMS)  # a new folder of the loader says here which rooms it builds on


def test_a_room_importing_upwards_is_found(tmp_path):
    """The check itself: planning -> fetch (a room not listed for it) and format -> the package are caught, lazy
    imports too; fetch -> format and the package -> any room are allowed."""
    package = tmp_path / "loader"
    for room_name in ("format", "fetch", "planning"):
        (package / room_name).mkdir(parents=True)
        (package / room_name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from loader.pipeline import load\n")
    (package / "pipeline.py").write_text("from loader.fetch import reader\nfrom loader.planning import plan\n")
    (package / "fetch" / "reader.py").write_text("from loader.format import index\n")
    (package / "format" / "index.py").write_text("def f():\n    from loader import pipeline\n")
    (package / "planning" / "plan.py").write_text("from loader.fetch.reader import x\n")
    assert room_violations(tmp_path) == ["loader.format.index (format) imports loader.pipeline (the package)",
                                         "loader.planning.plan (planning) imports loader.fetch.reader (fetch)"]


def test_import_loader_keeps_its_public_names():
    import loader

    assert sorted(loader.__all__) == ["DataSource", "Loader", "LoaderConfig", "LoaderIterator", "Packing",
                                      "ShardedSource", "StageResult", "load", "resolve", "stage", "token_info"]
    assert [name for name in loader.__all__ if not hasattr(loader, name)] == []
    from loader import images  # the image ops for random_map_fn=, by their short name

    assert images.RandomResizedCrop.__module__ == "loader.decoding.images"
