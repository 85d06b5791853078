"""The text a linearization trains on: the docstrings of the standard library's own sources (read with
`ast`, nothing imported), less any that shares a run of OVERLAP words with the text perplexity is scored on;
or a file of the user's, which must share no such run."""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

import torch

from harness.lm.config import Recipe
from harness.options import ArgumentError, read_text_file

OVERLAP = (
    12  # words: a training text sharing a run this long with the scored text is refused (the default one is cleaned)
)


HELD_OUT = 2  # training-text sequences held out (the errors and losses before and after each stage)


SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "pydoc_data",
    "site-packages",
    "turtledemo",
    "ensurepip",
    "tkinter",
    "venv",
    "__pycache__",
}  # of the standard library: tests, tools, and pydoc_data (the scored text)


MIN_DOCSTRING = 200  # characters: shorter docstrings are mostly signatures


@functools.lru_cache(maxsize=2)
def stdlib_docstrings(avoid: str) -> str:
    """The docstrings (over MIN_DOCSTRING characters) of the standard library's modules, classes and functions,
    read from the source files with `ast` in path order (nothing is imported, so nothing runs), less those that
    share a run of OVERLAP words with `avoid` (the scored text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen = _runs(avoid)
    parts = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > MIN_DOCSTRING and _shared_run(doc, seen) is None:
                parts.append(doc)
    return "\n\n".join(parts)


def _runs(text: str) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + OVERLAP]) for i in range(max(0, len(words) - OVERLAP + 1))}


def _shared_run(text: str, seen: set) -> str | None:
    """The first run of OVERLAP words of `text` that is in `seen`, or None."""
    words = text.split()
    for i in range(len(words) - OVERLAP + 1):
        if tuple(words[i : i + OVERLAP]) in seen:
            return " ".join(words[i : i + OVERLAP])
    return None


def training_text(path: str | None, scored: str) -> str:
    """The training text: the file, or the standard library's docstrings that share nothing with `scored`."""
    return stdlib_docstrings(scored) if path is None else read_text_file(path, "--train-text")


def training_sequences(tokenizer, recipe: Recipe, scored: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train (S, length), held out (HELD_OUT, length)): consecutive pieces of the training text, the last
    HELD_OUT held out. ArgumentError when the text holds fewer than HELD_OUT + 1 sequences."""
    ids = tokenizer(training_text(recipe.text, scored), add_special_tokens=False)["input_ids"]
    count = len(ids) // recipe.length
    where = recipe.text or "the standard library's docstrings"
    if count < HELD_OUT + 1:
        raise ArgumentError(
            f"--train-text: {where} holds {len(ids)} tokens, fewer than {HELD_OUT + 1} sequences of "
            f"--train-length {recipe.length}"
        )
    seqs = torch.tensor(ids[: count * recipe.length], dtype=torch.long).view(count, recipe.length)
    return seqs[:-HELD_OUT], seqs[-HELD_OUT:]


def check_disjoint(train: str, scored: str, where: str) -> None:
    """ArgumentError when the training text shares a run of OVERLAP words with the scored text: a model trained
    on what it is scored on would report a perplexity it did not earn."""
    run = _shared_run(train, _runs(scored))
    if run is not None:
        raise ArgumentError(
            f"--train-text: {where} shares a run of {OVERLAP} words with the text perplexity is scored "
            f"on (--text): {run[:120]!r}; train on a text disjoint from it"
        )
