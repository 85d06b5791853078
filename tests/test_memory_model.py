"""`bench memory`: what a model's attention layers keep for the backward (measured, one layer) and need in all."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import bench

# in a process of its own: measuring pins the allocator to a mapping a block, which would slow the suite after it
KEPT = r"""
import json, sys
from harness.core.kept import Shape, model_memory
n, layers = int(sys.argv[1]), int(sys.argv[2])
shape = Shape(batch=1, heads=4, kv_heads=4, head_dim=32)
found = {name: model_memory(name, {}, n, shape, layers, training, budget=2**40)
         for name in ("full_naive", "full") for training in (True, False) if training or name == "full"}
print(json.dumps({name: found[name] for name in found}))
"""


def test_textbook_attention_keeps_its_score_buffers_and_fused_attention_keeps_a_line_of_them():
    n, layers = 1024, 3
    done = subprocess.run(
        [sys.executable, "-c", KEPT, str(n), str(layers)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    matrix = 1 * 4 * n * n * 4  # B H N x N float32
    naive, fused = found["full_naive"], found["full"]
    # textbook softmax(Q K^T) V keeps its probabilities for both products' backward (and the scores' buffer)
    assert 1.5 * matrix <= naive["kept_layer"] <= 3.5 * matrix, naive
    assert fused["kept_layer"] < matrix / 8, fused  # the fused kernel keeps its output and a log-sum-exp a row
    for row in (naive, fused):
        assert row["kept"] == layers * row["kept_layer"] and row["total"] == row["kept"] + row["peak"]


def test_inference_keeps_nothing_and_needs_one_calls_peak_also_on_grouped_heads():
    args = ["--lengths", "512", "--variants", "full_naive,mamba2", "--inference", "--heads", "2", "--kv-heads", "1"]
    result = bench("memory", *args)
    assert result.exit_code == 0, result.output
    for name in ("full_naive", "mamba2"):  # (mamba2's gates are per K/V head: built with the hint)
        row = next(line for line in result.output.splitlines() if line.strip().startswith(name))
        assert row.split()[2:4] == ["0", "B"], row
    assert "inference" in result.output and "not counted" not in result.output


def test_a_call_past_the_budget_is_named_not_run_and_bad_input_is_refused():
    result = bench("memory", "--lengths", "1000000", "--variants", "full_naive")
    assert result.exit_code == 0, result.output
    assert "not counted: full_naive at N=1000000: a call is predicted to need" in " ".join(result.output.split())
    for args, named in (
        (["--variants", "nope"], "--variants"),
        (["--heads", "12", "--kv-heads", "5"], "--kv-heads 5"),
        (["--lengths", "0"], "--lengths"),
        (["--layers", "0"], "--layers"),
    ):
        refused = bench("memory", *args)
        assert refused.exit_code == 2 and named in refused.output, (args, refused.output)
