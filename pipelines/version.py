"""The tool's version, recorded in every manifest."""

from importlib import metadata

try:
    TOOL_VERSION = metadata.version("arrayrecord-platform")
except metadata.PackageNotFoundError:  # running from a source tree that was not installed
    TOOL_VERSION = "0+unknown"
