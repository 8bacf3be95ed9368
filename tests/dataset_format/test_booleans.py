import pytest

from dataset_format import booleans


@pytest.mark.parametrize("text,value", [("true", True), ("TRUE", True), (" 1 ", True), ("yes", True), ("On", True),
                                        ("false", False), ("0", False), ("No", False), ("off", False),
                                        ("ture", None), ("", None), ("2", None), ("none", None)])
def test_the_words_of_a_boolean(text, value):
    assert booleans.parse(text) is value
