"""docs/own_model.py: the user's own model by import path, as the docs show it."""

import json

from tests.conftest import REPO
from tests.trainer.conftest import train_here


def test_the_own_model_example_trains_digits(digits, tmp_path):
    proc = train_here(f"data={digits['train']}", f"eval_data={digits['test']}", "num_classes=10",
                      "model=own_model:ResidualMLP", "steps=300", "batch_size=32", "learning_rate=0.003",
                      "log_every=100", "eval_every=300", "checkpoint_every=300", f"workdir={tmp_path}",
                      path=REPO / "docs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model=own_model:ResidualMLP parameters=" in proc.stderr
    assert json.loads(proc.stdout)["summary"]["eval_accuracy"] >= 0.85
