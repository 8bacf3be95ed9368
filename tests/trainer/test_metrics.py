"""trainer/metrics.py: metrics.jsonl across restarts."""

import json
import logging

from trainer.metrics import NAME, MetricsWriter, read


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


def test_a_last_record_without_its_newline_keeps_the_next_record_apart(tmp_path, caplog):
    """A write cut just before its newline: the next record was appended to the same line, and the next restart
    dropped both as one torn line. Reading the records (the evaluator's restart) stopped at a torn line with a bare
    JSON error naming no file."""
    (tmp_path / NAME).write_text('{"step": 10, "loss": 2.0}\n{"step": 20, "loss": 1.5}')
    writer = MetricsWriter(str(tmp_path), start=20, tensorboard_dir=str(tmp_path / "tb"))
    writer.write({"step": 21, "loss": 1.4})
    writer.close()
    assert [r["step"] for r in read(str(tmp_path))] == [10, 20, 21]
    (tmp_path / NAME).write_text((tmp_path / NAME).read_text() + '{"step": 30, "lo')
    with caplog.at_level(logging.WARNING, logger="trainer.metrics"):
        assert [r["step"] for r in read(str(tmp_path))] == [10, 20, 21]
    assert f"{tmp_path / NAME}: line 4 is not a whole JSON record" in caplog.text


def _events(path):
    """The Event protos of a TensorBoard events file (records: length, its CRC, the data, the data's CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    data, events, at = path.read_bytes(), [], 0
    while at + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        events.append(Event.FromString(data[at + 12:at + 12 + length]))
        at += 12 + length + 4
    return events


def test_tensorboard_is_told_to_drop_the_steps_a_restart_repeats_as_metrics_jsonl_does(tmp_path):
    """The events of steps after the restart's (a stop's own row, rows logged after the last checkpoint) stayed in
    TensorBoard beside the repeated ones. A restarted writer's file begins with TensorBoard's purge marker: the
    file-version and session-start events at the first step it repeats (TensorBoard then drops the earlier files'
    events from there)."""
    import time

    first = MetricsWriter(str(tmp_path), 0)
    for step in (10, 20, 30):
        first.write({"step": step, "loss": float(step)})
    first.close()
    time.sleep(1.1)  # (the events files are named by the second they were opened)
    again = MetricsWriter(str(tmp_path), 20)  # restored from step 20's checkpoint: 30 is logged again
    again.write({"step": 30, "loss": 0.5})
    again.close()
    files = sorted((tmp_path / "tensorboard").iterdir())
    assert len(files) == 2
    restarted = _events(files[1])
    assert any(e.file_version and e.step == 21 for e in restarted), restarted
    assert any(e.session_log.status == e.session_log.START and e.step == 21 for e in restarted), restarted
    assert [(e.step, v.simple_value) for e in restarted for v in e.summary.value] == [(30, 0.5)]
    assert [(e.step, v.simple_value) for e in _events(files[0]) for v in e.summary.value] == [
        (10, 10.0), (20, 20.0), (30, 30.0)]
