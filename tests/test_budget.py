"""The house keeps its budget (issue 51): module docstrings of at most 15 lines, no module over 300 lines outside
the method files, pages of short paragraphs that open with their contents, and no harness code that names a
variant (facts about a method live in its spec)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_docs import _paragraphs

import variants

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("variants", "harness", "scripts", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py"))
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_module_docstrings_are_at_most_15_lines():
    long = {}
    for path in SOURCES:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and len(doc.splitlines()) > 15:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert not long, f"module docstrings over 15 lines (the detail belongs beside its code): {long}"


def test_no_module_over_300_lines_but_a_method_that_teaches_its_math_or_a_report():
    """A report that is one report stays one file (issue 69): a report.py may run to 400 lines."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in SOURCES
        if path.parts[len(ROOT.parts)] != "tests"
        and "methods" not in path.relative_to(ROOT).parts
        and (n := len(path.read_text().splitlines())) > (400 if path.name == "report.py" else 300)
    }
    assert not long, f"modules over 300 lines (one idea a file; a report 400): {long}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_docs_page_keeps_short_paragraphs_and_opens_with_its_contents(page):
    text = page.read_text()
    long = [(len(p.split()), p[:60]) for p in _paragraphs(text) if len(p.split()) > 60]
    assert not long, f"{page.name}: paragraphs over 60 words: {long}"
    headings = re.findall(r"^## (.+)$", text, re.M)
    top = text.split("\n## ", 1)[0]
    listed = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)$", top, re.M)
    expected = [re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings]
    assert headings and listed == expected, f"{page.name} opens with {listed}, its sections are {expected}"


def _strings(tree: ast.AST):
    """Every string constant of a module but its docstrings."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def test_no_harness_literal_names_a_variant():
    # a variant's name as a value, or an option scoped to one ('moba.block', 'sliding_window:window=64'):
    # what the harness needs of a method it reads from the spec
    names = "|".join(sorted(map(re.escape, variants.available()), key=len, reverse=True))
    naming = re.compile(rf"^({names})([.:]\w.*)?$")
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
        for path in sorted((ROOT / "harness").rglob("*.py"))
        for node in _strings(ast.parse(path.read_text()))
        if naming.match(node.value)
    ]
    assert not found, found


def test_the_literal_check_catches_a_name():
    tree = ast.parse('"""the full story"""\nBASELINE = "full"\nOPTIONS = {"moba.block": 8}\n')
    names = [node.value for node in _strings(tree)]
    assert names == ["full", "moba.block"]


def test_the_readers_keep_a_folder_a_run_kind():
    """harness/readers/ holds the shared helpers and a folder a run kind, not files grouped by name prefix."""
    top = sorted(p.name for p in (ROOT / "harness" / "readers").glob("*.py"))
    assert len(top) <= 8, f"harness/readers/ has {len(top)} files at its top (at most 8): {top}"
    assert {p.name for p in (ROOT / "harness" / "readers").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "speed",
        "quality",
        "lm",
        "advise",
    }


def test_every_variant_names_its_kind_for_the_figures():
    from conftest import shipped

    kinds = {"exact", "local and sparse", "kernel", "low-rank and compressed", "recurrent"}
    wrong = {n: variants.variant_class(n).spec.kind for n in shipped()}
    assert not {n: k for n, k in wrong.items() if k not in kinds}, wrong


def test_every_command_signature_is_one_line_an_option():
    """A command's options are aliases defined beside it (or in cli/common.py when commands share them): its
    signature reads as a list, one line an option, never a page."""
    long = {}
    for path in sorted((ROOT / "harness" / "cli").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.args.args and node.body:
                span = node.body[0].lineno - node.lineno - 1  # the def line to the docstring
                if span > len(node.args.args) + 1:
                    long[f"{path.name}:{node.name}"] = (span, len(node.args.args))
    assert not long, f"signatures longer than one line an option (lines, options): {long}"
