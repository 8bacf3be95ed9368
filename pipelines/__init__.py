"""Beam pipelines that convert TFRecord shards (or TFDS directories) into matched ArrayRecord shards.

    from pipelines import ConvertConfig, run_conversion
    outcome = run_conversion(ConvertConfig(input="data/*.tfrecord", output="out/"))

What they write (manifest, naming, codec, storage) is the `dataset_format` package, the contract with the
loader. Beam-dependent names load on first use, so `import pipelines` stays cheap.
"""

from dataset_format.manifest import Manifest, ShardEntry
from pipelines.config import ConvertConfig

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
