"""Help for a typed config, read from the config's own source: each field's type, default and comment, so `--help`
cannot drift from the code.

    print(keys_help(TrainConfig))   # "  steps: int = 1000  ..." one block per key

A field's description is its trailing comment (`steps: int = 1000  # ...`) or, when it has none, the comment lines
just above it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*([^=#]+?)\s*(?:=\s*(.+?))?\s*$")


def descriptions(cls) -> dict[str, str]:
    """{field name: its comment} from the class's source."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        code = line.split("#", 1)[0]
        match = _FIELD.match(code)
        if not match or match.group(1) not in names or match.group(1) in out:
            continue
        text = comments.get(number) if "#" in line else None
        if text is None:  # the comment block just above
            above, k = [], number - 1
            while k >= 1 and lines[k - 1].strip().startswith("#"):
                above.insert(0, comments.get(k, ""))
                k -= 1
            text = " ".join(above)
        out[match.group(1)] = text
    return out


def keys_help(cls, width: int = 100, choices: dict[str, str] | None = None) -> str:
    """Every field of a dataclass config: `name: type = default`, then its description, indented; `choices`: for
    some fields, the values they take (read by the caller from its registries), added to their description."""
    described = descriptions(cls)
    blocks = []
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = f" = {field.default!r}"
        elif field.default_factory is not dataclasses.MISSING:
            default = f" = {field.default_factory()!r}"
        else:
            default = " (required)"
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        head = f"  {field.name}: {kind}{default}"
        text = described.get(field.name, "")
        if choices and field.name in choices:
            text = f"{text} ({choices[field.name]})" if text else choices[field.name]
        body = textwrap.fill(text, width, initial_indent="      ", subsequent_indent="      ") if text else ""
        blocks.append(head + ("\n" + body if body else ""))
    return "\n".join(blocks)
