"""Test-only variants that misbehave on purpose, for the harness's fault tests.

Imported by name in each cell's process (`bench run --import fault_variants`). Each computes exact
attention (so it passes the correctness check at small N) unless its fault is triggered.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F

from variants import AttentionVariant, VariantSpec
import variants

CHECK_N_MAX = 64  # faults trigger only above this length, so the correctness check (run at N <= 64 here) passes


def _spec(name: str, summary: str) -> VariantSpec:
    return VariantSpec(name=name, summary=summary, reference="test only", time_complexity="-", memory_complexity="-")


class _Exact(AttentionVariant):
    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.shape[-2] > CHECK_N_MAX:
            self.fault(q)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fault(self, q):
        pass

    def flops(self, n_q, n_k, d, dv, causal):
        return 4.0 * n_q * n_k * d


def _register(cls):
    variants.unregister(cls.spec.name)
    return variants.register(cls)


@_register
class Raises(_Exact):
    spec = _spec("test_raises", "raises past N=64")

    def fault(self, q):
        raise ValueError("deliberate failure")


@_register
class Hangs(_Exact):
    spec = _spec("test_hangs", "sleeps forever past N=64")

    def fault(self, q):
        while True:
            time.sleep(1)


@_register
class KillsItself(_Exact):
    spec = _spec("test_kills_itself", "SIGKILLs its own process past N=64")

    def fault(self, q):
        os.kill(os.getpid(), signal.SIGKILL)


@_register
class Segfaults(_Exact):
    spec = _spec("test_segfaults", "dies of SIGSEGV past N=64")

    def fault(self, q):
        os.kill(os.getpid(), signal.SIGSEGV)


@_register
class Hog(_Exact):
    """Allocates N * 64 KiB more than it needs (and under-predicts it), to run into the memory budget."""

    spec = _spec("test_hog", "allocates N * 64 KiB")

    def fault(self, q):
        self._held = torch.ones(q.shape[-2] * 16384, device=q.device)  # float32: N * 64 KiB, written, so resident

    def memory_estimate(self, *args, **kwargs):
        return 0


ALLOC_MIB = 96


@_register
class AllocatesKnownAmount(_Exact):
    """Holds exactly ALLOC_MIB MiB during each call: the harness must report about that much."""

    spec = _spec("test_alloc", "allocates 96 MiB per call")

    def fault(self, q):
        buf = torch.ones(ALLOC_MIB * 2**20 // 4)
        buf.add_(1)

    def memory_estimate(self, *args, **kwargs):
        return ALLOC_MIB * 2**20


@_register
class Wrong(_Exact):
    """Off by a constant: the correctness check must catch it, and it must never be timed."""

    spec = _spec("test_wrong", "adds 0.1 to every output")

    def _attend(self, q, k, v, causal, key_padding_mask):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal) + 0.1


@_register
class Huge(_Exact):
    spec = _spec("test_huge", "predicts a petabyte")

    def memory_estimate(self, *args, **kwargs):
        return 2**50


@_register
class Slow(_Exact):
    """Sleeps 0.3 s per call past N=64: slow enough to kill the parent mid-run in a test."""

    spec = _spec("test_slow", "sleeps 0.3 s per call")

    def fault(self, q):
        time.sleep(0.3)


@_register
class RaisesMultiline(_Exact):
    """Raises an error whose reason is on its later lines, as Inductor's and xformers' errors do."""

    spec = _spec("test_raises_multiline", "raises a multi-line error past N=64")

    def fault(self, q):
        raise RuntimeError(
            "backend='inductor' raised:\nLoweringException: the real reason is here\n  target: flex_attention"
        )


@_register
class NoFlops(_Exact):
    """A plug-in variant without FLOPs: must cost its own cells, never the sweep."""

    spec = _spec("test_no_flops", "has no flops")

    def flops(self, n_q, n_k, d, dv, causal):
        raise NotImplementedError("test_no_flops has no FLOP count")


@_register
class BatchBug(_Exact):
    """Right for the first batch element, wrong for the others: a broadcasting bug the gate must see at B=1 runs."""

    spec = _spec("test_batch_bug", "wrong past the first batch element")

    def _attend(self, q, k, v, causal, key_padding_mask):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.cat([out[:1], out[1:] * 0.5])


class _FlexWrongOrder(variants.variant_class("sliding_window_flex")):
    """The flex band with a tile-skipping bug: key tiles listed in the wrong order. Right while every
    tile pair touches the band (short sequences), wrong once some are skipped."""

    spec = _spec("test_flex_wrong_order", "flex sliding window, tile order reversed")

    def _block_mask(self, n, causal, key_padding_mask, device):
        from torch.nn.attention.flex_attention import BlockMask

        from variants.methods.sliding_window_flex import TILE, sliding_window_mask_mod, tile_coverage

        touched, _ = tile_coverage(n, self.window, self.global_tokens, causal, device)
        touched = touched[None, None]
        order = torch.argsort(touched.to(torch.int8), dim=-1, stable=True).to(torch.int32)  # bug: untouched first
        return BlockMask.from_kv_blocks(
            touched.sum(-1, dtype=torch.int32),
            order,
            BLOCK_SIZE=TILE,
            mask_mod=sliding_window_mask_mod(self.window, self.global_tokens, causal, None),
            seq_lengths=(n, n),
        )


_register(_FlexWrongOrder)


@_register
class WrongDefinition(variants.variant_class("sliding_window")):
    """Wrong, and its own definition (`reference`) wrong the same way: only an independent reference can tell."""

    spec = _spec("test_wrong_definition", "sliding window whose output and definition both add 0.1")

    def _attend(self, q, k, v, causal, key_padding_mask):
        return super()._attend(q, k, v, causal, key_padding_mask) + 0.1

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        return super().reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask) + 0.1
