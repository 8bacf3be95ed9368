"""Functions that loader worker processes and Ray actors import by name when they unpickle a test's loader: kept in
a module of their own, with nothing heavy to import (tests/loader/conftest.py imports the converter, and Beam with
it: seconds in every worker process)."""


def flat_ids(value):
    """A tokenize function worker processes can import (a lambda does not pickle)."""
    import numpy as np

    return np.asarray(value).reshape(-1)
