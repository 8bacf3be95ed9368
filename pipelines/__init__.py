"""Beam pipelines that convert TFRecord shards (or TFDS directories) into matched ArrayRecord shards.

    from pipelines import ConvertConfig, run_conversion
    outcome = run_conversion(ConvertConfig(input="data/*.tfrecord", output="out/"))

The manifest (`pipelines.manifest`) is the contract with the loader; it imports nothing heavy.
Beam-dependent names load on first use, so `import pipelines.manifest` stays cheap.
"""

from pipelines.config import ConvertConfig
from pipelines.manifest import Manifest, ShardEntry

__all__ = ["ConvertConfig", "ConvertToArrayRecord", "Manifest", "ShardEntry", "run_conversion", "verify"]


def __getattr__(name):
    if name == "run_conversion":
        from pipelines.run import run_conversion

        return run_conversion
    if name == "ConvertToArrayRecord":
        from pipelines.convert import ConvertToArrayRecord

        return ConvertToArrayRecord
    if name == "verify":
        from pipelines.verify import verify

        return verify
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
