"""Host checks of a decoding call's requests (``dspark_jax.decode_requests``)."""

import numpy as np
import pytest

from dspark_jax.decode_requests import bucket, cache_capacity, check_requests
from dspark_jax.sampling import TOP_K_ALL


def test_no_top_k_and_no_top_p_mean_no_filter():
    """``None`` is "no filter": top-p exactly 1 (the whole distribution), top-k every token."""
    _, _, requests = check_requests(
        [[1, 2], [3]], vocab_size=16, max_new_tokens=4, temperature=1.0, top_k=None, top_p=None, stop_tokens=None
    )
    assert np.asarray(requests.top_p).tolist() == [1.0, 1.0]
    assert np.asarray(requests.top_k).tolist() == [TOP_K_ALL, TOP_K_ALL]


@pytest.mark.parametrize("lookahead", [0, 3])
def test_the_default_capacity_is_the_smallest_multiple_of_16_holding_every_request(lookahead):
    """Sized from the requests and rounded up, so nearby request sizes share compiled programs."""
    for prompt in range(1, 40, 3):
        for max_new in (1, 5, 16, 17):
            lengths, new = np.array([prompt, 2], np.int32), np.array([max_new, 1], np.int32)
            need = max(prompt + max_new, 2 + 1) + lookahead  # the longest request
            got = cache_capacity(None, lengths, new, lookahead)
            assert got % 16 == 0 and need <= got < need + 16, (prompt, max_new, got)
            assert got == bucket(need)
            assert cache_capacity(need, lengths, new, lookahead) == need  # a given capacity is kept


@pytest.mark.parametrize("step", [1, 8, 16])
def test_bucket_is_the_smallest_multiple_of_step_at_least_n(step):
    """Brute force: the first of step, 2·step, … that is >= n (a multiple is kept: 16 → 16)."""
    for n in range(1, 200):
        want = next(m for m in range(step, 10 * n + step, step) if m >= n)
        assert bucket(n, step) == want, (n, step)
    assert (bucket(16), bucket(17)) == (16, 32)
