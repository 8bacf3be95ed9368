"""The close-name phrase the trainer's and the loader's errors share."""

from dataset_format.suggest import did_you_mean

KEYS = ["steps", "seq_len", "packing", "shuffle"]


def test_one_name_several_names_and_none_close():
    assert did_you_mean(["stepz"], KEYS) == "did you mean steps?"
    assert did_you_mean(["packng", "seq_length"], KEYS) == "did you mean packing for packng, seq_len for seq_length?"
    assert did_you_mean(["qqqqq"], KEYS) == ""
    assert did_you_mean(["qqqqq", "shufle"], iter(KEYS)) == "did you mean shuffle for shufle?"
