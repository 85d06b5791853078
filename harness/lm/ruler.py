"""A RULER-style group of retrieval tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), generated offline in the passkey's filler, each prompt exactly L tokens:

- multikey: four needles "One of the special magic numbers for <word> is: <7 digits>." with different words;
  the question names one (three are distractors). Correct: its number in the answer.
- multivalue: four needles of one word with four numbers; the question asks for all. Correct: all four.
- vartrack: a chain VAR A = <5 digits>, VAR B = VAR A, ... of five variables spread through the filler; the
  question asks which variables hold the number. Correct: all five names.

As RULER: the needles' places are drawn uniformly over the filler, greedy generation, scored on the generated
text. Unlike RULER: one filler (the passkey's repeated sentences, RULER's "noise" haystack) and no essay
haystack, no chat template, and exact match of every expected string rather than RULER's partial recall.
"""

from __future__ import annotations

import random

from harness.lm.config import FILLER
from harness.options import ArgumentError

NEEDLES = 4  # needles of multikey (one asked, three distractors) and values of multivalue
CHAIN = 5  # variables of vartrack's chain
NEW_TOKENS = {"multikey": 12, "multivalue": 48, "vartrack": 40}  # greedy tokens generated for the answer
WORDS = (
    "amber anchor basil canyon cedar cobalt coral delta ember falcon fennel garnet harbor hazel indigo jasper "
    "juniper lagoon lantern maple marble meadow nectar onyx orchid pebble quartz raven saffron sierra spruce "
    "thistle topaz tundra velvet willow zephyr"
).split()


def prompt(tokenizer, subtask: str, length: int, seed: int, trial: int) -> tuple[list[int], list[str]]:
    """(token ids of exactly `length` tokens, the strings a correct answer holds) for one trial, drawn from
    (seed, subtask, length, trial): the same prompt for every attention."""
    ids, expected, _ = prompt_parts(tokenizer, subtask, length, seed, trial)
    return ids, expected


def prompt_parts(tokenizer, subtask: str, length: int, seed: int, trial: int) -> tuple[list[int], list[str], int]:
    """`prompt`'s ids and expected strings, and how many of the ids (the last) are the question."""
    rng = random.Random(f"ruler-{seed}-{subtask}-{length}-{trial}")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if subtask == "vartrack":
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(CHAIN)]
        value = str(rng.randrange(10_000, 100_000))
        needles = [f" VAR {names[0]} = {value}. "] + [f" VAR {b} = VAR {a}. " for a, b in zip(names, names[1:])]
        intro = "Memorize and track the chain of variable assignments hidden in the following text.\n"
        question = (
            f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
            f"According to the chain of variable assignments in the text above, {CHAIN} variables are assigned "
            f"the value {value}, they are:"
        )
        expected = names
    else:
        words = rng.sample(WORDS, NEEDLES if subtask == "multikey" else 1)
        numbers = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(NEEDLES)]
        pairs = list(zip(words, numbers)) if subtask == "multikey" else [(words[0], n) for n in numbers]
        rng.shuffle(pairs)  # (the asked needle anywhere among the distractors)
        needles = [f" One of the special magic numbers for {w} is: {n}. " for w, n in pairs]
        asked = words[0]
        intro = (
            "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
            "I will quiz you about the numbers afterwards.\n"
        )
        plural = "numbers" if subtask == "multivalue" else "number"
        verb = "are" if subtask == "multivalue" else "is"
        question = (
            f"\nWhat {verb} {'all ' if subtask == 'multivalue' else ''}the special magic {plural} for {asked} "
            f"mentioned in the provided text? The special magic {plural} for {asked} mentioned in the provided text {verb}"
        )
        expected = numbers if subtask == "multivalue" else [numbers[0]]
    return _spliced(encode, intro, needles, question, length, rng, subtask), expected, len(encode(question))


def _spliced(encode, intro: str, needles: list[str], question: str, length: int, rng, subtask: str) -> list[int]:
    """intro + filler with the needles at uniform random places, in their order + question: exactly `length`."""
    head, tail, pieces = encode(intro), encode(question), [encode(n) for n in needles]
    room = length - len(head) - len(tail) - sum(map(len, pieces))
    if room < 0:
        raise ArgumentError(
            f"--lengths {length}: too short for the RULER {subtask} prompt ({length - room} tokens without filler)"
        )
    filler = encode(FILLER)
    filler = (filler * (room // len(filler) + 1))[:room]
    cuts = sorted(rng.randrange(room + 1) for _ in pieces)
    ids, last = list(head), 0
    for cut, piece in zip(cuts, pieces):
        ids += filler[last:cut] + piece
        last = cut
    return ids + filler[last:] + tail


def correct(answer: str, expected: list[str]) -> bool:
    """Exact match: every expected string in the generated text (spaces removed, as the passkey's check)."""
    text = answer.replace(" ", "")
    return all(e.replace(" ", "") in text for e in expected)
