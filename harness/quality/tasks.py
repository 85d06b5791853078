"""Synthetic tasks that probe what efficient attention trades away: copying, associative recall, and
multi-query associative recall as Zoology defines it (`mqar`).

Both are generated on the fly from a seeded generator (no downloads). `batch` returns
(inputs, targets, loss_mask), each (batch, T): the model reads `inputs` causally and is scored on
predicting `targets` where `loss_mask` is True. `sample` returns the same and `distance`: for each
scored position, how far back the token that holds the answer sits — the reach attention needs
(a window of width w, keys t-w..t, sees distances <= w).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from harness.quality.config import recall_layout


class Sample(NamedTuple):
    inputs: Tensor  # (B, T) token ids
    targets: Tensor  # (B, T) the next token
    mask: Tensor  # (B, T) bool: scored positions
    distance: Tensor  # (B, T) long: where mask, positions from the scored one back to its answer; else -1


@dataclass(frozen=True)
class CopyTask:
    """A random string of `length` symbols, a separator, then the same string again.

    Only the reproduced part is scored: targets at the positions after the separator. Every scored
    position reads its answer exactly `length` positions back (the symbol it copies).
    Tokens: symbols 0..vocab-1, separator = vocab.
    """

    length: int
    vocab: int | None = None  # default 16

    def __post_init__(self):
        if self.length < 1:
            raise ValueError(f"copy: the length must be at least 1, got {self.length}")
        if self.symbols < 2:
            raise ValueError(f"copy: the vocabulary must hold at least 2 symbols, got {self.symbols}")

    @property
    def symbols(self) -> int:
        return 16 if self.vocab is None else self.vocab

    @property
    def vocab_size(self) -> int:
        return self.symbols + 1

    @property
    def seq_len(self) -> int:
        return 2 * self.length  # inputs: string + separator + string without its last symbol

    def sample(self, size: int, generator: torch.Generator) -> Sample:
        src = torch.randint(0, self.symbols, (size, self.length), generator=generator)
        sep = torch.full((size, 1), self.symbols)
        seq = torch.cat([src, sep, src], dim=1)  # (B, 2L + 1)
        inputs, targets = seq[:, :-1], seq[:, 1:]
        mask = torch.zeros_like(targets, dtype=torch.bool)
        mask[:, self.length :] = True  # from the separator on, the next token is the copy
        # the target at position t is seq[t + 1] = src[t - L], which sits at input position t - L
        distance = torch.where(mask, self.length, -1)
        return Sample(inputs, targets, mask, distance)

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        return self.sample(size, generator)[:3]


@dataclass(frozen=True)
class RecallTask:
    """Multi-query associative recall (as in the Zoology work): key-value pairs, then queries of earlier keys.

    `pairs` distinct keys from the first half of the vocabulary, each bound to a value from the second
    half (k1 v1 k2 v2 ...). Then the queries: a bound key, and its value. Scored: the value after each
    query key.

    - `queries` None (the quick preset): the rest of the `length` tokens are queries of keys drawn at
      random, so a key is asked several times and its answer can be read from an earlier query.
    - `queries` = q <= pairs: q distinct keys are each asked once, at random places among filler
      tokens (token id `vocab`): the answer is only in the binding, so the distance is up to the whole
      sequence and difficulty comes from it.

    The distance of a scored position is counted to the nearest earlier place the answer is stated
    (the binding's value, or the value after an earlier query of the same key).
    """

    length: int
    vocab: int | None = None  # default: max(64, 2 * pairs), so the keys stay distinct
    pairs: int | None = None  # default: length // 8
    queries: int | None = None

    def __post_init__(self):
        p = self.num_pairs
        if p < 1:
            raise ValueError(f"recall: the number of pairs must be at least 1, got {p}")
        if p > self.symbols // 2:  # keys come from the first half of the vocabulary
            raise ValueError(f"recall: {p} distinct keys need a vocabulary of at least {2 * p}, got {self.symbols}")
        needed = 2 * p + 2 * (self.queries if self.queries is not None else 1)
        if self.length < max(needed, 4):
            asked = "at least one query" if self.queries is None else f"{self.queries} queries"
            raise ValueError(
                f"recall: {p} pairs need a length of at least {max(needed, 4)} (the pairs and {asked}), got {self.length}"
            )
        if self.queries is not None and not 1 <= self.queries <= min(p, self.slots):
            raise ValueError(f"recall: queries must be between 1 and the number of pairs ({p}), got {self.queries}")

    @property
    def num_pairs(self) -> int:
        return recall_layout(self.length, self.pairs)[0]

    @property
    def symbols(self) -> int:
        return self.vocab if self.vocab is not None else max(64, 2 * self.num_pairs)

    @property
    def slots(self) -> int:
        """Two-token places after the bindings: each a query (key, value) or filler."""
        return recall_layout(self.length, self.pairs)[1]

    @property
    def num_queries(self) -> int:
        return self.queries if self.queries is not None else self.slots

    @property
    def vocab_size(self) -> int:
        return self.symbols + (self.queries is not None)  # + the filler token

    @property
    def seq_len(self) -> int:
        return 2 * (self.num_pairs + self.slots) - 1

    def sample(self, size: int, generator: torch.Generator) -> Sample:
        p, half, slots = self.num_pairs, self.symbols // 2, self.slots
        keys = torch.rand(size, half, generator=generator).argsort(dim=1)[:, :p]  # distinct keys per example
        values = torch.randint(half, self.symbols, (size, p), generator=generator)
        if self.queries is None:  # every slot a query, keys drawn with repetition
            asked = torch.randint(0, p, (size, slots), generator=generator)
            where = torch.arange(slots).expand(size, slots)
        else:  # q distinct keys, each asked once, at q random slots in increasing order
            asked = torch.rand(size, p, generator=generator).argsort(dim=1)[:, : self.queries]
            where = torch.rand(size, slots, generator=generator).argsort(dim=1)[:, : self.queries].sort(dim=1).values
        bindings = torch.stack([keys, values], dim=2).flatten(1)  # k1 v1 k2 v2 ...
        tail = torch.full((size, 2 * slots), self.symbols)  # filler
        rows = torch.arange(size)[:, None]
        tail[rows, 2 * where] = keys.gather(1, asked)
        tail[rows, 2 * where + 1] = values.gather(1, asked)
        seq = torch.cat([bindings, tail], dim=1)  # (B, 2p + 2 slots)
        inputs, targets = seq[:, :-1], seq[:, 1:]
        mask = torch.zeros_like(targets, dtype=torch.bool)
        query_pos = 2 * p + 2 * where  # position of each query key; its value is the target there
        mask[rows, query_pos] = True
        # nearest earlier statement of each asked binding: its value's position, updated as queries answer
        last_value = (2 * torch.arange(p) + 1).expand(size, p).clone()
        distance = torch.full_like(targets, -1)
        for m in range(asked.shape[1]):
            k = asked[:, m : m + 1]
            distance[rows[:, 0], query_pos[:, m]] = query_pos[:, m] - last_value.gather(1, k)[:, 0]
            last_value.scatter_(1, k, query_pos[:, m : m + 1] + 1)
        return Sample(inputs, targets, mask, distance)

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        return self.sample(size, generator)[:3]


@dataclass(frozen=True)
class MQARTask:
    """Multi-query associative recall exactly as Zoology generates it (Arora et al. 2023, `multiquery_ar`).

    `pairs` keys drawn without repeats from ids 1 .. V/2 - 1, each bound to a value drawn without repeats
    from V/2 .. V - 1, come first (k1 v1 k2 v2 ...); the rest of the L tokens are 0, except that each key is
    asked once, at an even offset of the query region chosen by a power law (p(gap g) ∝ (g + 1)^(a - 1),
    a = 0.01: most queries come soon after the bindings). Scored: the value, at each query's position only
    (its input never states the answer again). L tokens in all; 4 · pairs <= L.
    """

    length: int
    vocab: int | None = None  # Zoology's 8192
    pairs: int | None = None  # default: length // 16 (Zoology's (64, 4), (128, 8), (256, 16))
    power_a: float = 0.01

    def __post_init__(self):
        p = self.num_pairs
        if p < 1:
            raise ValueError(f"mqar: the number of pairs must be at least 1, got {p}")
        if self.length % 2 or 4 * p > self.length:
            raise ValueError(f"mqar: {p} pairs need an even length of at least {4 * p} (4 x pairs), got {self.length}")
        if self.symbols // 2 - 1 < p:
            raise ValueError(f"mqar: {p} distinct keys need a vocabulary of at least {2 * p + 2}, got {self.symbols}")

    @property
    def num_pairs(self) -> int:
        return self.pairs if self.pairs is not None else max(1, self.length // 16)

    @property
    def symbols(self) -> int:
        return 8192 if self.vocab is None else self.vocab

    @property
    def vocab_size(self) -> int:
        return self.symbols

    @property
    def seq_len(self) -> int:
        return self.length

    def sample(self, size: int, generator: torch.Generator) -> Sample:
        p, half, context = self.num_pairs, self.symbols // 2, 2 * self.num_pairs
        space = (self.length - context) // 2  # places a query can take, every other token of the query region
        keys = distinct_draws(size, p, 1, half, generator)
        values = distinct_draws(size, p, half, self.symbols, generator)
        weights = self.power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (self.power_a - 1)
        gaps = torch.multinomial(weights.expand(size, space), p, replacement=False, generator=generator)
        seq = torch.zeros(size, self.length + 1, dtype=torch.long)
        seq[:, 0:context:2], seq[:, 1:context:2] = keys, values
        rows = torch.arange(size)[:, None]
        query_pos = context + 2 * gaps  # the i-th key is asked at query_pos[:, i]
        seq[rows, query_pos] = keys
        inputs = seq[:, :-1]
        targets = torch.zeros_like(inputs)
        targets[rows, query_pos] = values
        mask = torch.zeros_like(inputs, dtype=torch.bool)
        mask[rows, query_pos] = True
        distance = torch.full_like(inputs, -1)
        distance[rows, query_pos] = query_pos - (2 * torch.arange(p) + 1)  # back to the value it binds
        return Sample(inputs, targets, mask, distance)

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        return self.sample(size, generator)[:3]


def distinct_draws(rows: int, count: int, low: int, high: int, generator: torch.Generator) -> Tensor:
    """(rows, count) ids from low .. high - 1, distinct within each row, uniform over such draws: drawn with
    repeats, and the rows that repeat one drawn again (few where count << high - low; a ranking where not)."""
    span = high - low
    if 4 * count > span:
        return torch.rand(rows, span, generator=generator).argsort(dim=1)[:, :count] + low
    out = torch.randint(low, high, (rows, count), generator=generator)
    redo = torch.arange(rows)
    while True:
        ordered = out[redo].sort(dim=1).values
        redo = redo[(ordered[:, 1:] == ordered[:, :-1]).any(dim=1)]
        if not len(redo):
            return out
        out[redo] = torch.randint(low, high, (len(redo), count), generator=generator)


TASKS = ("copy", "recall", "mqar")
TASK_OPTIONS = {"copy": ("vocab",), "recall": ("vocab", "pairs", "queries"), "mqar": ("vocab", "pairs")}
TASK_CLASSES = {"copy": CopyTask, "recall": RecallTask, "mqar": MQARTask}


def make_task(name: str, length: int, **options):
    """The task `name` at `length`; options a task does not take (see TASK_OPTIONS) are ignored."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    taken = {k: v for k, v in options.items() if k in TASK_OPTIONS[name] and v is not None}
    return TASK_CLASSES[name](length, **taken)


def distance_buckets(distance: Tensor, correct: Tensor, mask: Tensor) -> list[dict]:
    """Accuracy over power-of-two distance buckets [1,1], [2,3], [4,7], ...: a list of
    {"min", "max", "accuracy", "count"} for the buckets that hold scored positions (counts sum to mask.sum())."""
    d, right = distance[mask], correct[mask]
    if (d < 1).any():
        raise ValueError("every scored position needs a distance >= 1")
    exponent = torch.floor(torch.log2(d.double())).long()
    out = []
    for e in exponent.unique().tolist():
        sel = exponent == e
        out.append(
            {
                "min": 2**e,
                "max": 2 ** (e + 1) - 1,
                "accuracy": right[sel].float().mean().item(),
                "count": int(sel.sum()),
            }
        )
    return out
