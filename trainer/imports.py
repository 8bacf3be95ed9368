"""Extension points by name: a built-in name, or `package.module:attr` (uvicorn's `app:app`) for the user's own.

    resolve("cnn", {"cnn": CNN}, "model")                  # -> CNN
    resolve("my_pkg.nets:ResNet", {"cnn": CNN}, "model")   # -> my_pkg.nets.ResNet (imported now)

Anything that does not resolve is a ValueError of one line: the module that did not import and why, or the
attributes the module has.
"""

from __future__ import annotations

import importlib
from typing import Any


def resolve(spec: str, builtins: dict[str, Any], what: str) -> Any:
    if ":" not in spec:
        if spec in builtins:
            return builtins[spec]
        from dataset_format.suggest import did_you_mean

        hint = did_you_mean([spec], builtins)
        raise ValueError(f"{what}={spec!r} is not one of {sorted(builtins)}" + (f" ({hint})" if hint else "")
                         + f"; or name your own as {what}=package.module:attr")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what}={spec!r}: write {what}=package.module:attr (both parts)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - a user module can fail in any way: name it and why
        raise ValueError(f"{what}={spec!r}: module {module_name!r} does not import ({type(e).__name__}: {e}); check "
                         "the name and that its directory is on PYTHONPATH") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            raise ValueError(f"{what}={spec!r}: module {module_name!r} has no attribute {attr!r}; it has "
                             f"{public[:20]}")
        obj = getattr(obj, part)
    return obj
