"""log_linear beyond the registry's contract (its definition, gradients, decoding = forward: the shared tests):
the decoding state holds one D x Dv bucket per set bit of the positions so far, so its bytes grow at most as
log2 N + 1 states; a level count that cannot hold N is refused, naming the count it needs."""

from __future__ import annotations

import pytest
import torch

import variants


def test_the_state_grows_with_the_bits_of_n():
    attn = variants.build("log_linear", num_heads=2, head_dim=8, levels=12)
    state = attn.init_state(1, 2, 8, 8)
    one = 2 * 8 * 8 * 4  # a bucket a K/V head
    for n in range(1, 1025):
        x = torch.randn(1, 2, 1, 8)
        state = attn.prefill(x, x, x, state)
        assert state.nbytes() == bin(n).count("1") * one <= (n.bit_length()) * one


def test_a_level_count_that_cannot_hold_n_is_refused():
    attn = variants.build("log_linear", num_heads=2, head_dim=8, levels=5)
    x = torch.randn(1, 2, 17, 8)
    with pytest.raises(ValueError, match=r"levels=5 fits up to 16 positions, not N=17; use levels=6"):
        attn(x, x, x, causal=True)
    state = attn.prefill(x[:, :, :16], x[:, :, :16], x[:, :, :16], attn.init_state(1, 2, 8, 8))
    with pytest.raises(ValueError, match=r"cannot step to 17 positions: levels=5 fits up to 16 positions, not N=17"):
        attn.step(x[:, :, 16:], x[:, :, 16:], x[:, :, 16:], state)  # decoding is held to it too
    with pytest.raises(ValueError, match=r"chunk_size=3 is invalid; expected a power of two"):
        variants.build("log_linear", num_heads=2, head_dim=8, chunk_size=3)
