"""The README and the pages under docs/ stay valid: every relative link and image exists, and every
`bench` command they show names a command and options that `bench` has."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from harness.cli import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]


def _links(text: str) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"(https?:|mailto:|#)", target)]


def _commands(text: str) -> list[str]:
    """Every `bench ...` command line: in inline code and in code blocks (a '$ ' prompt dropped)."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        found += [line.removeprefix("$ ") for line in block.splitlines()]
    found += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    commands = []
    for line in found:
        for part in re.split(r"&&|\|\||;|\|", line):
            part = part.strip()
            if part.startswith("bench ") and not part.startswith("bench_"):
                commands.append(part)
    return commands


def test_the_pages_exist_and_link_to_each_other():
    assert len(PAGES) >= 8, PAGES
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:-1]:
        assert f"(docs/{page.name})" in readme, f"the README does not link to docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_image_exists(page):
    missing = [target for target in _links(page.read_text()) if not (page.parent / target.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_bench_command_names_a_command_and_options_bench_has(page):
    group = typer.main.get_command(app)
    bad = []
    for command in _commands(page.read_text()):
        try:
            words = shlex.split(command.replace("…", ""))
        except ValueError:
            words = command.split()
        if len(words) < 2 or words[1].startswith("-"):
            continue  # "bench --help", or prose naming the tool
        sub = group.commands.get(words[1])
        if sub is None:
            bad.append(f"{command!r}: no command {words[1]!r}")
            continue
        known = {opt for param in sub.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}
        for word in words[2:]:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and flag not in known:
                bad.append(f"{command!r}: bench {words[1]} has no option {flag}")
    assert not bad, "\n".join(bad)


def test_the_check_catches_a_bad_link_and_a_bad_option(tmp_path):
    """The checks can fail: a page with a missing figure and a misspelt option."""
    text = "![x](../results/nowhere.png) and `bench run --max-length 16384` and `bench rnu`"
    assert _links(text) == ["../results/nowhere.png"]
    assert _commands(text) == ["bench run --max-length 16384", "bench rnu"]
    group = typer.main.get_command(app)
    assert (
        "--max-length" not in {opt for p in group.commands["run"].params for opt in p.opts}
        and "rnu" not in group.commands
    )


def test_the_deployment_sentence_is_what_the_specs_say():
    # the README said every variant exports with torch.export and only sliding_window_flex lacks ONNX; moba cannot
    # export, deltanet and gated_deltanet have no ONNX: the sentence is generated from the specs (scripts/menu_table.py)
    import importlib.util

    from harness.readers.tables import replace_block

    spec = importlib.util.spec_from_file_location("menu_table", ROOT / "scripts" / "menu_table.py")
    menu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(menu)
    sentence = menu.deploy_sentence()
    for page in ("README.md", "docs/variants.md"):
        text = (ROOT / page).read_text()
        assert "<!-- deploy:start -->" in text and replace_block(text, "deploy", sentence) == text, page


def _paragraphs(text: str) -> list[str]:
    """The prose of a page: its blank-line-separated blocks, a list item each, without code, tables, images,
    headings or markers."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    blocks = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if not line.startswith(("|", "#", "![", "<!--"))]
        item = []
        for line in lines:
            if re.match(r"\s*([-*]|\d+\.) ", line) and item:
                blocks.append(" ".join(item))
                item = []
            item.append(line)
        if item:
            blocks.append(" ".join(item))
    return blocks


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md"])
def test_the_front_pages_keep_their_prose_budget(page):
    # a paragraph (or list item) of at most 60 words; the README a front page of at most 120 lines whose first
    # figure shows within its first 40
    text = (ROOT / page).read_text()
    long = [(len(p.split()), p[:60]) for p in _paragraphs(text) if len(p.split()) > 60]
    assert not long, f"{page}: paragraphs over 60 words: {long}"
    if page == "README.md":
        lines = text.splitlines()
        assert len(lines) <= 120, len(lines)
        assert any(line.startswith("![") for line in lines[:40]), (
            "the README's first figure is not in its first 40 lines"
        )


def test_every_option_help_is_at_most_30_words():
    # --help answers in a line or two; the details live in docs/ (the longest option help was 98 words)
    group = typer.main.get_command(app)
    long = [
        (name, param.name, len(param.help.split()))
        for name, command in group.commands.items()
        for param in command.params
        if getattr(param, "help", None) and len(param.help.split()) > 30
    ]
    assert not long, long


def test_a_default_in_a_help_text_is_read_from_where_it_is_set():
    """One default in one place (issue 69): the window and stride `bench run --help` states are read from the
    methods' signatures (every method's that differs is named), `bench quality --help`'s from the presets; the
    source reader agrees with inspect on every keyword option of every registered method."""
    import inspect

    from helpers import bench

    import variants
    from harness.cli.common import option_defaults
    from harness.quality.presets import PRESETS

    methods = Path(variants.__file__).parent / "methods"
    signatures = {}  # option -> {method file: default}, from the classes themselves
    for name in variants.available():
        cls = variants.variant_class(name)
        if Path(inspect.getfile(cls)).parent == methods and "__init__" in vars(cls):
            for option, p in inspect.signature(cls.__init__).parameters.items():
                if p.kind is p.KEYWORD_ONLY and p.default is not p.empty:
                    signatures.setdefault(option, {})[Path(inspect.getfile(cls)).stem] = p.default
    assert len(signatures) > 10
    for option, found in signatures.items():
        read = option_defaults(option)
        assert {stem: read.get(stem) for stem in found} == found, option
    text = " ".join(bench("run", "--help", columns=200).output.split())
    windows = signatures["window"]
    assert f"'window'; default {windows['sliding_window']}; window_linear {windows['window_linear']})" in text
    assert f"stride c (default {signatures['compression']['memory_compressed']})" in text
    text = " ".join(bench("quality", "--help", columns=200).output.split())
    assert f"quick {PRESETS['quick']['options']['window']}, long {PRESETS['long']['options']['window']}:" in text
    from harness.quality.config import TrainConfig  # the recipe's defaults, where no preset sets them

    assert f"Layers (default {TrainConfig.layers};" in text and f"Attention heads (default {TrainConfig.heads};" in text
    assert f"Training batch size (default {TrainConfig.batch})." in text
