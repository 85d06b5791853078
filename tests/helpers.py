"""What the tests share: the CLI invocation, tiny-run settings, run rows, a bench process to interrupt,
synthetic run directories and a fresh-process memory probe. Test modules import from here (and from
conftest's references), never from each other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from harness.cli import app
from harness.policy import recorded_facts
from harness.store.rows import Row
from harness.store.storage import RowWriter, read_rows, write_metadata

TESTS = Path(__file__).resolve().parent
FAST = [
    "--check-len",
    "32",
    "--repeats",
    "2",
    "--min-time",
    "0",
    "--warmup",
    "0",
    "--warmup-time",
    "0",
    "--heads",
    "2",
    "--head-dim",
    "16",
    "--no-report",
    "--peak-time",
    "0.05",
]


def bench(*args: str, columns: int = 200):
    """`bench ARGS...` in this process (typer's CliRunner), with a terminal `columns` wide."""
    return CliRunner().invoke(app, [str(arg) for arg in args], env={"COLUMNS": str(columns)})


def run_dir_rows(path: Path) -> pd.DataFrame:
    return pd.read_json(path / "results.jsonl", lines=True)


def _default_sigint() -> None:
    # bench as a user runs it at a terminal: a test run started in the background (a non-interactive
    # shell's `cmd &`) inherits SIGINT ignored, and Python keeps an inherited ignore, so Ctrl-C would never arrive
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def bench_process(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )


def wait_for_rows(path: Path, count: int, proc: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.time() + limit
    while time.time() < deadline:
        if len(read_rows(path)) >= count:
            return
        if proc.poll() is not None:
            pytest.fail(f"bench exited early: {proc.stdout.read()}")
        time.sleep(0.1)
    pytest.fail("no rows appeared")


SLOW_RUN = [
    "--import",
    "fault_variants",
    "--variants",
    "test_slow,full",
    "--lengths",
    "65,66,67,68",
    "--passes",
    "fwd",
    *FAST,
]


NS = [256, 512, 1024, 2048, 4096]


def make_run(path: Path, slow_factor: float = 1.0, partial: bool = False) -> Path:
    """A run dir: full ~ n^2, linear ~ n, full_naive stops with oom at 2048, flex skipped for fwdbwd."""
    path.mkdir(parents=True)
    write_metadata(
        path,
        {
            "config": {
                "dtype": "float32",
                "batch": 1,
                "heads": 8,
                "head_dim": 64,
                "options": {},
                "memory_budget": {"cpu": 2**33},
            },
            "environment": {
                "command": "bench run --test",
                "python": "3.11",
                "versions": {"torch": "2.13.0"},
                "cpu": {"model": "Test CPU", "usable_cores": 2, "memory_bytes": 2**34},
                "git": {"commit": "abc", "dirty": False},
                "started": "2026-01-01T00:00:00+00:00",
            },
            "machine": {"matmul_peak_gflops": {"cpu/float32": 100.0}, "gpu": None},
            "variants": recorded_facts(
                ("full", "linear", "full_naive", "sliding_window_flex")
            ),  # as bench run records them
        },
    )
    rows = []
    for pass_ in ("fwd", "fwdbwd"):
        for n in NS:
            rows.append(_row("full", pass_, n, 1e-9 * n * n * slow_factor, 64 * n))
            rows.append(_row("linear", pass_, n, 2e-6 * n * slow_factor, 256 * n))
            if n < 2048:
                rows.append(_row("full_naive", pass_, n, 3e-9 * n * n, 4 * n * n))
            else:
                rows.append(
                    _row(
                        "full_naive",
                        pass_,
                        n,
                        None,
                        None,
                        "oom" if n == 2048 else "skipped",
                        "killed" if n == 2048 else "series stopped at N=2048 (oom)",
                    )
                )
            if pass_ == "fwd":
                rows.append(_row("sliding_window_flex", pass_, n, 1e-6 * n, 128 * n))
            else:
                rows.append(
                    _row(
                        "sliding_window_flex",
                        pass_,
                        n,
                        None,
                        None,
                        "skipped",
                        "sliding_window_flex has no backward on cpu",
                    )
                )
    if partial:
        rows = rows[: len(rows) // 2]
    with RowWriter(path) as writer:
        for row in rows:
            writer.append(row)
    return path


def _row(variant, pass_, n, t, mem, status="ok", message=""):
    return Row(
        device="cpu",
        variant=variant,
        pass_=pass_,
        causal=False,
        n=n,
        status=status,
        message=message,
        time_median_s=t,
        time_min_s=t,
        time_iqr_s=0.0 if t else None,
        peak_bytes=mem,
        flops=4.0 * n * n * 64 * 8 if t else None,
        gflops=(4.0 * n * n * 64 * 8 / t / 1e9) if t else None,
        timed_calls=3 if t else 0,
    )


# runs in a fresh process so nothing else's memory or allocator state is counted
MEASURE = r"""
import json, sys, torch, variants
from harness.core.memory import measure_peak, pin_mmap_threshold
name, cases, backward, options, dv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", json.loads(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(int(sys.argv[6]))
heads = options.get("num_heads", 1)
kv_heads = options.pop("kv_heads", heads)  # (grouped-query: k and v of fewer heads than q)
attn = variants.build(name, **options)
peaks = []
for n, causal in cases:
    q = torch.randn(1, heads, n, 32, requires_grad=backward)
    k = torch.randn(1, kv_heads, n, 32, requires_grad=backward)
    v = torch.randn(1, kv_heads, n, dv, requires_grad=backward)
    def call():
        if backward:
            attn(q, k, v, causal=causal).sum().backward()
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                attn(q, k, v, causal=causal)
    call()  # warm-up (and compile)
    pin_mmap_threshold()
    peaks.append(measure_peak(call, torch.device("cpu"))["peak_bytes"])
    del q, k, v
print(json.dumps(peaks))
"""


def peak_bytes(
    name: str,
    n: int | list[int],
    backward: bool,
    dv: int = 32,
    causal: bool | list[bool] = False,
    threads: int = 2,
    **options,
):
    """Peak extra bytes of one call at (B, H) = (1, 1) (or num_heads, with kv_heads K/V heads), D = 32 and the
    given Dv, in a fresh process of `threads` CPU threads (1 where two run side by side: the two cores shared,
    not oversubscribed): one figure, or one per (length, causal) pair when given lists (measured in turn)."""
    many = isinstance(n, list) or isinstance(causal, list)
    lengths = n if isinstance(n, list) else [n]
    modes = causal if isinstance(causal, list) else [causal]
    cases = [[length, mode] for mode in modes for length in lengths]
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            MEASURE,
            name,
            json.dumps(cases),
            "1" if backward else "0",
            json.dumps(options),
            str(dv),
            str(threads),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    return peaks if many else peaks[0]


def side_by_side(calls: list) -> list:
    """Each of `calls` (no-argument functions, each starting a process of one thread and waiting for it) run two
    at a time on the suite's two cores: for peaks of memory and outputs, never times, which a neighbour would
    change. (Two processes of two threads each measured slower than one after the other.)"""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda call: call(), calls))


def selected(request, test: str) -> list[dict]:
    """The parameters of each case of `test` this session runs: what a module fixture measuring them all at
    once (side by side) needs to know."""
    return [item.callspec.params for item in request.session.items if item.originalname == test]


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: 256 tokens, one per byte (and an end-of-text token)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def tiny_llama_config(**changes):
    """A tiny Llama's config (GQA: 4 query heads on 2 K/V heads, 512 positions, the byte tokenizer's 257 ids)."""
    import transformers

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    ids = dict(vocab_size=257, eos_token_id=256, bos_token_id=256)
    return transformers.LlamaConfig(
        **{**sizes, **ids, "num_key_value_heads": 2, "max_position_embeddings": 512, **changes}
    )


def save_tiny_llama(folder: Path) -> Path:
    """A tiny random Llama (GQA, 512 positions) and the byte tokenizer saved in `folder`, as from_pretrained reads."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def save_tiny_gpt2(folder: Path) -> Path:
    """A tiny random GPT-2 (learned positions, 512 of them) and the byte tokenizer saved in `folder`."""
    import transformers

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=257, n_embd=32, n_layer=1, n_head=4, n_positions=512)
    ).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder
