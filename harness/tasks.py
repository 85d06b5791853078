"""Synthetic tasks that probe what efficient attention trades away: copying and associative recall.

Both are generated on the fly from a seeded generator (no downloads) and return
(inputs, targets, loss_mask), each (batch, T): the model reads `inputs` causally and is scored on
predicting `targets` where `loss_mask` is True.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CopyTask:
    """A random string of `length` symbols, a separator, then the same string again.

    Only the reproduced part is scored: targets at the positions after the separator.
    Tokens: symbols 0..vocab-1, separator = vocab.
    """

    length: int
    vocab: int = 16

    @property
    def vocab_size(self) -> int:
        return self.vocab + 1

    @property
    def seq_len(self) -> int:
        return 2 * self.length  # inputs: string + separator + string without its last symbol

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        src = torch.randint(0, self.vocab, (size, self.length), generator=generator)
        sep = torch.full((size, 1), self.vocab)
        seq = torch.cat([src, sep, src], dim=1)  # (B, 2L + 1)
        inputs, targets = seq[:, :-1], seq[:, 1:]
        mask = torch.zeros_like(targets, dtype=torch.bool)
        mask[:, self.length :] = True  # from the separator on, the next token is the copy
        return inputs, targets, mask


@dataclass(frozen=True)
class RecallTask:
    """Multi-query associative recall (as in the Zoology work): key-value pairs, then queries of earlier keys.

    `pairs` distinct keys from the first half of the vocabulary, each bound to a value from the second
    half; the rest of the `length` tokens are queries — a bound key drawn at random, then its value —
    so a key is recalled at various distances from its binding. Scored: the value after each query.
    """

    length: int
    vocab: int = 64
    pairs: int | None = None  # default: length // 8

    def __post_init__(self):
        if self.length < 2 * self.num_pairs + 2:
            raise ValueError(f"recall: {self.num_pairs} pairs need a length of at least {2 * self.num_pairs + 2}, got {self.length}")
        if not 1 <= self.num_pairs <= self.vocab // 2:
            raise ValueError(f"recall: {self.num_pairs} distinct keys need a vocabulary of at least {2 * self.num_pairs}, got {self.vocab}")

    @property
    def num_pairs(self) -> int:
        return self.pairs if self.pairs is not None else max(1, self.length // 8)

    @property
    def num_queries(self) -> int:
        return (self.length - 2 * self.num_pairs) // 2

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def seq_len(self) -> int:
        return 2 * (self.num_pairs + self.num_queries) - 1

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        p, q, half = self.num_pairs, self.num_queries, self.vocab // 2
        keys = torch.rand(size, half, generator=generator).argsort(dim=1)[:, :p]  # distinct keys per example
        values = torch.randint(half, self.vocab, (size, p), generator=generator)
        asked = torch.randint(0, p, (size, q), generator=generator)  # which binding each query recalls
        q_keys, q_values = keys.gather(1, asked), values.gather(1, asked)
        bindings = torch.stack([keys, values], dim=2).flatten(1)  # k1 v1 k2 v2 ...
        queries = torch.stack([q_keys, q_values], dim=2).flatten(1)  # q1 a1 q2 a2 ...
        seq = torch.cat([bindings, queries], dim=1)  # (B, 2p + 2q)
        inputs, targets = seq[:, :-1], seq[:, 1:]
        mask = torch.zeros_like(targets, dtype=torch.bool)
        mask[:, 2 * p :: 2] = True  # after each query key, its value
        return inputs, targets, mask


TASKS = ("copy", "recall")


def make_task(name: str, length: int, **options):
    if name == "copy":
        return CopyTask(length, **options)
    if name == "recall":
        return RecallTask(length, **options)
    raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
