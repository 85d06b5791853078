"""A new attention method is one file: dropped into a copy of `variants/methods/`, with no other edit,
it is in every command, the micro-benchmarks, `variants.hf` and the shared contract tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent

# attention at a fixed temperature inside a window: softmax(q kᵀ / (T √D)) over |i - j| <= w. Its scale
# is part of its options (1 / (T √D)), so it computes the function of sliding_window built with that scale
METHOD = '''
"""Tempered window: exact softmax attention at a fixed temperature T, restricted to |i - j| <= w (a test's method)."""

import torch

from .._base import AttentionVariant, VariantSpec, dense_mask, register
from .._utils import dense_attention


@register
class TemperedWindow(AttentionVariant):
    spec = VariantSpec(
        name="tempered_window",
        summary="softmax(q k^T / (T sqrt(D))) over a band |i - j| <= w, dense",
        reference="a test of attnbench: one file is one method",
        time_complexity="O(N^2 D)",
        memory_complexity="O(N^2)",
        supports_cross_attention=False,
        same_function_as="sliding_window",
        reach_option="window",
        function_options=("window",),
        examples=((("window", 3),),),
    )

    def __init__(self, *, window: int = 4, temperature: float = 2.0, **base):
        """
        Args:
            window: w, how far apart a query and a key may be.
            temperature: T, the scores are divided by T (on top of 1 / sqrt(D)).
        """
        super().__init__(**base)
        self._check_int("window", window, 1)
        self.window, self.temperature, self.global_tokens = window, float(temperature), 0

    def _scale(self, q):
        return (self.scale if self.scale is not None else q.shape[-1] ** -0.5) / self.temperature

    def _band(self, q, k, causal, key_padding_mask):
        n_q, n_k = q.shape[-2], k.shape[-2]
        i = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        allowed = ((i - j).abs() <= self.window)[None, None]
        mask = dense_mask(n_q, n_k, causal, key_padding_mask, q.device)
        return allowed if mask is None else allowed & mask

    def _attend(self, q, k, v, causal, key_padding_mask):
        return dense_attention(q, k, v, self._band(q, k, causal, key_padding_mask), self._scale(q))

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        return dense_attention(q, k, v, self._band(q, k, causal, key_padding_mask), self._scale(q))

    def flops(self, n_q, n_k, d, dv, causal):
        return 2.0 * n_q * n_k * (d + dv)
'''

SCRIPT = r"""
import json, sys
from pathlib import Path
from typer.testing import CliRunner
import torch
import variants
from harness.cli import app
from harness.store.storage import read_rows

out = Path(sys.argv[1])
assert Path(variants.__file__).parent == Path.cwd() / "variants", variants.__file__  # the copy, not the project's
def bench(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output

found = {}
found["registered"] = "tempered_window" in variants.available()
found["list"] = "tempered_window" in bench("list")
fast = ["--check-len", "32", "--repeats", "2", "--min-time", "0", "--warmup", "0", "--warmup-time", "0", "--heads", "2",
        "--head-dim", "16", "--peak-time", "0.05"]
bench("run", "--variants", "tempered_window,full", "--lengths", "32,64", "--passes", "fwd,fwdbwd", "--causal", "both",
      "--out", out / "speed", *fast)
found["run"] = sorted((r["pass"], r["causal"], r["n"], r["status"]) for r in read_rows(out / "speed") if r["variant"] == "tempered_window")
tiny = ["--task", "recall", "--lengths", "32", "--steps", "4", "--d-model", "16", "--heads", "2", "--layers", "1", "--batch", "4",
        "--window", "2", "--no-cost"]
bench("quality", "--variants", "tempered_window", *tiny, "--out", out / "quality")
found["quality"] = sorted({r["variant"] for r in read_rows(out / "quality", "quality.jsonl") if r.get("final")})
found["window_verdict"] = "`tempered_window` (w=2)" in (out / "quality" / "REPORT.md").read_text()
bench("quality", "--variants", "sliding_window", *tiny, "--out", out / "quality-sw")
found["advise"] = bench("advise", "--len", "64", "--pass", "fwd", out / "speed", out / "quality-sw")
bench("viz", "--variants", "tempered_window", "--out", out / "patterns.png")
found["viz"] = (out / "patterns.png").exists()

import variants.hf as vh
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
model = vh.use(LlamaForCausalLM(config).double().eval(), "tempered_window", window=3)
ids = torch.randint(1, 61, (1, 10), generator=torch.Generator().manual_seed(1))
kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
found["hf"] = model.generate(ids, use_cache=True, **kwargs).tolist() == model.generate(ids, use_cache=False, **kwargs).tolist()
print(json.dumps(found))
"""


def test_a_method_is_one_file(tmp_path):
    # the copy is what `import variants` finds first: processes start in tmp_path (sys.path[0])
    shutil.copytree(ROOT / "variants", tmp_path / "variants", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "variants" / "methods" / "tempered_window.py").write_text(textwrap.dedent(METHOD))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    pytest_q = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # three independent processes, two at a time on the suite's two cores: the commands, the micro-benchmarks
    # and the shared contract tests (which must collect the new method and pass)
    commands = {
        "commands": [sys.executable, "-c", SCRIPT, str(tmp_path / "out")],
        "benchmarks": [
            *pytest_q,
            *map(str, [ROOT / "benchmarks", "--benchmark-disable", "--bench-lengths", "64"]),
            *["--bench-variants", "tempered_window"],
        ],
        "contract": [
            *pytest_q,
            *map(str, [ROOT / "tests" / "test_interface.py", ROOT / "tests" / "test_bottom_right.py"]),
            *["-k", "tempered_window"],
        ],
    }

    def run(args):
        return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(commands, pool.map(run, commands.values())))

    assert done["commands"].returncode == 0, done["commands"].stderr[-3000:]
    found = json.loads(done["commands"].stdout.strip().splitlines()[-1])
    assert found["registered"] and found["list"] and found["viz"] and found["hf"]
    assert found["run"] == sorted([p, c, n, "ok"] for p in ("fwd", "fwdbwd") for c in (False, True) for n in (32, 64))
    assert found["quality"] == ["tempered_window"] and found["window_verdict"]
    assert "accuracy of sliding_window (the same function)" in found["advise"]

    for name, at_least in (("benchmarks", 2), ("contract", 25)):
        out = done[name].stdout
        assert done[name].returncode == 0, out[-3000:]
        passed = int(out.strip().splitlines()[-1].split(" passed")[0].split()[-1])
        assert passed >= at_least, out[-1000:]
