"""The tool's version, recorded in every manifest."""

from importlib import metadata


def _version() -> str:
    # (Dataflow workers given the conversion alone install it as arrayrecord-platform-convert: pipelines/dataflow.py)
    for name in ("arrayrecord-platform", "arrayrecord-platform-convert"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return "0+unknown"  # running from a source tree that was not installed


TOOL_VERSION = _version()
