"""A training host without Beam: load converted data from gs://, decode it, stage it and train, on the GCS emulator.

The work runs in a fresh process (as `python -m trainer` would on a TPU or GPU VM) that reports which heavy
modules it imported: the loader and the trainer reach Cloud Storage through dataset_format's google-cloud-storage
layer, so Beam (and TensorFlow) never load.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from dataset_format import example_proto
from pipelines import ConvertConfig, run_conversion
from tests.conftest import REPO, write_tfrecord_shards

pytestmark = pytest.mark.gcs

SCRIPT = r'''
import json, sys
import numpy as np
import loader
from trainer import TrainConfig, train_and_evaluate

examples, tfds_dir, workdir, staged = sys.argv[1:5]
direct = next(iter(loader.load(examples, batch_size=6, shuffle=False)))          # tf.train.Example, read from gs://
local = loader.stage(examples, staged)                                             # copied through google-cloud-storage
from_disk = next(iter(loader.load(staged, batch_size=6, shuffle=False)))
tfds = next(iter(loader.load(tfds_dir, batch_size=4, shuffle=False, split="train")))  # TFDS FeaturesDict decoding
summary = train_and_evaluate(TrainConfig(data=tfds_dir, eval_data=tfds_dir, workdir=workdir, model="mlp", steps=1,
                                         batch_size=8, log_every=1))
print(json.dumps({
    "direct": {k: np.asarray(v).tolist() for k, v in direct.items()},
    "same_after_staging": all(np.array_equal(direct[k], from_disk[k]) for k in direct),
    "staged": local.copied,
    "tfds": {k: list(np.asarray(v).shape) for k, v in tfds.items()},
    "loss": summary["loss"],
    "eval_examples": summary["eval_examples"],
    "modules": sorted(m for m in ("apache_beam", "tensorflow") if m in sys.modules),
}))
'''


def test_a_training_host_loads_stages_and_trains_from_gcs_without_beam(tmp_path, gcs_bucket, gcs_emulator,
                                                                       tfds_digits):
    bucket, _ = gcs_bucket
    records = [example_proto.encode_example({"x": [i, 2 * i], "label": i % 3}) for i in range(10)]
    write_tfrecord_shards(tmp_path / "raw", [records[:4], records[4:]])
    examples = f"gs://{bucket}/examples"
    tfds_dir = f"gs://{bucket}/tfds/digits/1.0.0"
    for config in (ConvertConfig(input=str(tmp_path / "raw" / "*.tfrecord"), output=examples),
                   ConvertConfig(input=str(tfds_digits), output=tfds_dir)):
        assert run_conversion(config, ["--direct_num_workers=1"]).ok

    proc = subprocess.run([sys.executable, "-c", SCRIPT, examples, tfds_dir, str(tmp_path / "work"),
                           str(tmp_path / "staged")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**gcs_emulator, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                               "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)})

    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["modules"] == []  # neither Beam nor TensorFlow was imported
    assert report["direct"] == {"label": [0, 1, 2, 0, 1, 2], "x": [[i, 2 * i] for i in range(6)]}
    assert report["same_after_staging"] and report["staged"] == 2
    assert report["tfds"] == {"image": [4, 8, 8, 1], "label": [4]}
    assert np.isfinite(report["loss"])
    test_split = [s for s in json.loads((tfds_digits / "dataset_info.json").read_text())["splits"] if s["name"] == "test"]
    assert report["eval_examples"] == sum(int(n) for n in test_split[0]["shardLengths"])  # the "test" split, on gs://
