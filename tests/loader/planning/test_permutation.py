import numpy as np
import pytest

from loader.planning.permutation import Permutation


@pytest.mark.parametrize("n", list(range(1, 70)) + [1000, 4096, 4097, 2**16 + 1, 2**18 + 1, 1_000_003])
def test_every_length_is_an_exact_permutation(n):
    out = Permutation(n, seed=3, epoch=1)(np.arange(n))
    assert np.array_equal(np.sort(out), np.arange(n))


def test_fixed_expected_sequences():
    # Pinned: any change to the permutation changes every user's data order. Update only on purpose.
    assert Permutation(10, seed=0, epoch=0)(np.arange(10)).tolist() == [7, 4, 2, 1, 5, 3, 9, 8, 0, 6]
    assert Permutation(10, seed=1, epoch=0)(np.arange(10)).tolist() == [9, 2, 3, 0, 6, 5, 4, 7, 1, 8]
    assert Permutation(10, seed=0, epoch=1)(np.arange(10)).tolist() == [7, 0, 1, 6, 2, 5, 3, 8, 4, 9]


def test_seeds_and_epochs_are_uncorrelated():
    n = 20_000
    base = Permutation(n, 0, 0)(np.arange(n))
    others = [Permutation(n, 0, 1), Permutation(n, 1, 0), Permutation(n, 1, 1)]
    assert abs(np.corrcoef(np.arange(n), base)[0, 1]) < 0.05
    for other in others:
        assert abs(np.corrcoef(base, other(np.arange(n)))[0, 1]) < 0.05
    # seed s in epoch e+1 is not seed s+1 in epoch e (grain's seed+epoch scheme)
    assert not np.array_equal(Permutation(n, 0, 1)(np.arange(n)), Permutation(n, 1, 0)(np.arange(n)))


def test_works_for_a_billion_records_without_materialising():
    p = Permutation(10**9, seed=0, epoch=0)
    out = p(np.array([0, 1, 10**9 - 1]))
    assert ((0 <= out) & (out < 10**9)).all() and len(set(out.tolist())) == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="empty dataset"):
        Permutation(0, 0, 0)
    with pytest.raises(IndexError):
        Permutation(5, 0, 0)(np.array([5]))


@pytest.mark.parametrize("n", [1, 2, 3, 10, 69, 4097, 1_000_003])
def test_inverse_gives_each_records_position(n):
    p = Permutation(n, seed=3, epoch=2)
    positions = np.arange(n)
    assert np.array_equal(p.inverse(p(positions)), positions)
    assert np.array_equal(p(p.inverse(positions)), positions)
    # record r is at position inverse(r) of epoch 0, seed 0: [7, 4, 2, 1, 5, 3, 9, 8, 0, 6] above
    assert Permutation(10, seed=0, epoch=0).inverse(np.arange(10)).tolist() == [8, 3, 2, 5, 1, 4, 9, 0, 7, 6]
    with pytest.raises(IndexError):
        p.inverse(np.array([n]))
