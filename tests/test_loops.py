"""The loop detector on hand-built answers: where a loop starts, and what must not count as one."""

import random

import pytest

from nemo_dflash.data.loops import LoopDetector, find_loop_start


def _unique(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_clean_answer_does_not_loop():
    assert find_loop_start(_unique(400)) is None
    assert find_loop_start([]) is None
    assert find_loop_start(_unique(10)) is None


def test_loop_mid_answer_starts_at_the_first_repeated_copy():
    prefix, unit = _unique(100), _unique(20, start=5000)
    ids = prefix + unit * 10
    assert find_loop_start(ids) == 120  # one copy of the unit is kept
    # the same when the cap cuts the last copy in the middle
    assert find_loop_start(ids[:-7]) == 120


def test_single_token_loop_keeps_one_token():
    ids = _unique(50) + [7] * 100
    assert find_loop_start(ids) == 51


def test_long_paragraph_loop():
    ids = _unique(30) + _unique(150, start=9000) * 4
    assert find_loop_start(ids) == 180


def test_sampled_loop_with_mutations_is_found_near_its_start():
    rng = random.Random(0)
    unit = _unique(30, start=7000)
    tail = []
    for _ in range(15):
        copy = list(unit)
        copy[rng.randrange(30)] = rng.randrange(100, 200)  # one sampled deviation per copy
        tail += copy
    ids = _unique(200) + unit + tail
    start = find_loop_start(ids)
    assert start is not None and 200 + 30 <= start <= 200 + 60


def test_code_with_repeated_line_shapes_is_not_a_loop():
    # if x == k: return "name_k"  -- every line shares its shape, not its n-grams
    indent, if_, x, eq, colon, nl, ret = 1, 2, 3, 4, 5, 6, 8
    ids = []
    for k in range(40):
        ids += [indent, if_, x, eq, 100 + k, colon, nl, indent, indent, ret, 300 + k, nl]
    assert find_loop_start(ids) is None


def test_numbered_list_with_shared_prefix_is_not_a_loop():
    ids = []
    for k in range(30):
        ids += [10, 11, 500 + k, 12, 13, 14] + _unique(8, start=2000 + 10 * k) + [15]
    assert find_loop_start(ids) is None


def test_code_quoted_twice_is_not_a_loop():
    function = _unique(150, start=3000)
    ids = _unique(40) + function + _unique(30, start=8000) + function
    assert find_loop_start(ids) is None


def test_closing_sentence_said_twice_is_not_a_loop():
    closing = _unique(15, start=6000)
    ids = _unique(100) + closing + _unique(200, start=4000) + closing
    assert find_loop_start(ids) is None


def test_thresholds_are_configurable_and_checked():
    ids = _unique(100) + _unique(20, start=5000) * 3  # only 3 copies: 40 looping tokens
    assert find_loop_start(ids) is None
    assert find_loop_start(ids, LoopDetector(min_tokens=16, min_copies=1.5)) == 120
    with pytest.raises(ValueError, match="min_ratio"):
        LoopDetector(min_ratio=0)


def test_gram_ids_equal_the_row_unique_they_replace():
    """The packed n-gram ids give, for every position, the first occurrence that np.unique(axis=0)
    of the n-gram rows gives (the slow reference), for small and large vocabularies and n-gram sizes."""
    import numpy as np

    from nemo_dflash.data.loops import _gram_ids

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 4, 6, 7, 9):
        for vocab in (3, 50, 151_936, 2**21 - 1, 2**40):
            for _ in range(20):
                ids = rng.integers(0, vocab, size=int(rng.integers(n, 200)))
                grams = np.lib.stride_tricks.sliding_window_view(ids, n)
                _, first, inverse = np.unique(grams, axis=0, return_index=True, return_inverse=True)
                got_first, got_inverse = _gram_ids(ids, n)
                assert (got_first[got_inverse] == first[inverse.reshape(-1)]).all()
