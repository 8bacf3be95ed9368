"""trainer/metrics.py: metrics.jsonl across restarts."""

import json
import logging

from trainer.metrics import NAME, MetricsWriter


def test_a_restart_drops_later_records_and_a_torn_line_without_stopping(tmp_path, caplog):
    """A line cut short (a crash as it was written) stopped every restart with a bare JSON error (exit 2)."""
    (tmp_path / NAME).write_text('{"step": 5, "loss": 2.0}\n{"step": 10, "loss": 1.5}\n{"step": 15, "loss": 1.2}\n'
                                 '{"step": 20, "lo')
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        writer = MetricsWriter(str(tmp_path), start=10, tensorboard_dir=str(tmp_path / "tb"))
        writer.write({"step": 11, "loss": 1.4})
        writer.close()
    assert [json.loads(line)["step"] for line in (tmp_path / NAME).read_text().splitlines()] == [5, 10, 11]
    assert f"{tmp_path / NAME}: line 4 is not a whole JSON record ('{{\"step\": 20, \"lo'...): dropped" in caplog.text
    assert "dropped 1 record(s) after step 10" in caplog.text
