"""What the micro-benchmarks measure: the cases (variant x N x pass x causal), and the session's
built, gated variants. Timing and memory go through `harness.core` (calls, gate, timing), as in `bench run`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import variants
from variants._base import VariantSpec
from variants.methods.sliding_window import LongformerPattern
from harness.core import measure
from harness.core.calls import make_inputs, set_threads
from harness.core.gate import CHECK_BATCH, gate, gate_length
from harness.fmt import fmt_bytes
from harness.options import ArgumentError, merge_options, parse_lengths, parse_list, parse_option
from harness.policy import memory_budgets, resolve_variants
from harness.sweep.config import Cell, RunConfig
from harness.sweep.fate import predicted_bytes, useful_flops

FLEX = "flex_attention (torch)"  # the yardstick of the sliding-window variants: torch's FlexAttention, called directly


class FlexDirect(LongformerPattern):
    """torch's compiled `flex_attention` with a band mask from torch's own `create_block_mask`: what a
    user would write without attnbench. Not registered; its dense definition is the Longformer band's."""

    spec = VariantSpec(
        name=FLEX,
        summary="FlexAttention, called directly with create_block_mask",
        reference="torch.nn.attention.flex_attention",
        time_complexity="O(N w D)",
        memory_complexity="O(N D)",
        supports_cross_attention=False,
        backward_devices=("cuda",),
        subquadratic=True,
    )

    def __init__(self, *, window: int = 256, **base):
        super().__init__(window=window, global_tokens=0, **base)
        self._masks: dict = {}

    def _attend(self, q, k, v, causal, key_padding_mask):
        from torch.nn.attention.flex_attention import create_block_mask

        from variants.methods.sliding_window_flex import RECOMPILE_LIMIT, compiled_flex_attention

        n, w = q.shape[-2], self.window
        key = (n, causal, str(q.device))
        if key not in self._masks:

            def band(b, h, i, j):
                return ((i - j).abs() <= w) & (j <= i) if causal else (i - j).abs() <= w

            self._masks[key] = create_block_mask(band, None, None, n, n, device=q.device.type)
        if not torch.is_grad_enabled():
            q, k, v = q.detach(), k.detach(), v.detach()
        # as the variant does: past Dynamo's recompile limit, an error, never its eager fallback (N x N scores)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            return compiled_flex_attention(q.device.type)(q, k, v, block_mask=self._masks[key], scale=self._scale(q))


def registered(label: str) -> str:
    """The registered variant behind a case's label: 'linear[feature_map=relu]' -> 'linear'."""
    return label.split("[", 1)[0]


@dataclass(frozen=True)
class Case:
    variant: str  # the label: a registered name, or NAME[name=value,...] for a --bench-also entry
    n: int
    pass_: str
    causal: bool

    @property
    def id(self) -> str:
        return f"{self.variant}-N{self.n}-{self.pass_}{'-causal' if self.causal else ''}"

    @property
    def name(self) -> str:
        """The registered variant behind the label."""
        return registered(self.variant)

    @property
    def group(self) -> str:
        """One table per (pass, N, causal): the variants side by side."""
        return f"{self.pass_} N={self.n}{' causal' if self.causal else ''}"


def _settings(config) -> dict:
    try:
        b, h, d = (int(x) for x in config.getoption("--bench-shape").split(","))
        return {
            "lengths": parse_lengths(config.getoption("--bench-lengths")),
            "device": config.getoption("--bench-device"),
            "variants": resolve_variants(config.getoption("--bench-variants"), (config.getoption("--bench-device"),)),
            "passes": parse_list(config.getoption("--bench-passes"), "--bench-passes", ("fwd", "fwdbwd")),
            "causal": {"no": (False,), "yes": (True,), "both": (False, True)}[config.getoption("--bench-causal")],
            "dtype": config.getoption("--bench-dtype"),
            "batch": b,
            "heads": h,
            "head_dim": d,
            "window": config.getoption("--bench-window"),
            "options": merge_options(
                config.getoption("--bench-option") or [],
                window=config.getoption("--bench-window"),
                compression=config.getoption("--bench-compression"),
            ),
            "also": dict(_also(text) for text in config.getoption("--bench-also") or []),
        }
    except (ArgumentError, ValueError) as err:
        raise pytest.UsageError(str(err)) from None


def _also(text: str) -> tuple[str, dict]:
    """'linear feature_map=relu chunk_size=32' -> ('linear[feature_map=relu,chunk_size=32]', {options})."""
    name, *pairs = text.split()
    variants.variant_class(name)  # ValueError listing the registered names
    options = dict(parse_option(pair) for pair in pairs)
    return f"{name}[{','.join(f'{key}={value}' for key, value in options.items())}]", options


def cases(config) -> list[Case]:
    s = _settings(config)
    names = [name for name in s["variants"] if variants.variant_class(name).unavailable_reason(s["device"]) is None]
    names += [
        label
        for label in s["also"]
        if variants.variant_class(registered(label)).unavailable_reason(s["device"]) is None
    ]
    if any(
        variants.variant_class(registered(name)).spec.reach_option for name in names
    ):  # a windowed method: its yardstick too
        names.append(FLEX)
    return [
        Case(name, n, pass_, causal)
        for name in names
        for n in s["lengths"]
        for pass_ in s["passes"]
        for causal in s["causal"]
    ]


class Suite:
    """The session: settings, the matmul peak, and each (variant, causal) built once and gated once."""

    def __init__(self, config):
        self.s = _settings(config)
        self.memory = config.getoption("--bench-memory")
        self.disabled = config.getoption("benchmark_disable", False)
        self.device = torch.device(self.s["device"])
        set_threads()
        self.peak_gflops = None if self.disabled else measure.matmul_peak(self.s["device"], self.s["dtype"])["gflops"]
        gpu = {"free_bytes": torch.cuda.mem_get_info()[0]} if self.device.type == "cuda" else None
        self.budgets = memory_budgets("auto", (self.s["device"],), {"gpu": gpu})
        self._built: dict = {}
        self._gates: dict = {}

    def build(self, name: str):
        if name not in self._built:
            opts = self.s["options"]
            if name == FLEX:
                attn = FlexDirect(window=self.s["window"])
            elif name in self.s["also"]:
                attn = variants.build(
                    registered(name),
                    device=self.device,
                    num_heads=self.s["heads"],
                    head_dim=self.s["head_dim"],
                    **self.s["also"][name],
                )
            else:
                attn = variants.build(
                    name,
                    device=self.device,
                    num_heads=self.s["heads"],
                    head_dim=self.s["head_dim"],
                    **variants.options_taken(name, opts),
                )
            self._built[name] = attn.to(self.device, getattr(torch, self.s["dtype"]))
        return self._built[name]

    def skip_reason(self, case: Case) -> str | None:
        """Why the case cannot run here: the variant's spec, or (as in bench run) its predicted memory
        above the automatic budget (60% of the available RAM, 90% of the free GPU memory)."""
        attn = self.build(case.variant)
        reason = attn.mode_unsupported_reason(case.causal)
        if reason:
            return reason
        reason = attn.length_unsupported_reason(case.n, case.n)
        if reason:
            return f"{case.variant} at N={case.n}: {reason}"
        reason = attn.backward_unsupported_reason(self.s["device"]) if case.pass_ == "fwdbwd" else None
        reason = reason or attn.dtype_unsupported_reason(self.s["device"], self.s["dtype"])
        if reason:
            return reason
        predicted = predicted_bytes(*self._cell(case), attn)
        budget = dict(self.budgets).get(self.s["device"])
        if budget is not None and predicted > budget:
            return f"predicted {fmt_bytes(predicted)} > memory budget {fmt_bytes(budget)}"
        return None

    def gated(self, case: Case):
        """The built variant, after it passed the correctness gate for this causal mode (pytest.fail otherwise:
        a variant that disagrees with its definition is never timed)."""
        attn = self.build(case.variant)
        key = (case.variant, case.causal)
        if key not in self._gates:
            s = self.s
            backward = attn.backward_unsupported_reason(s["device"]) is None and "fwdbwd" in s["passes"]
            n = gate_length(attn, 320, max(s["lengths"]))
            self._gates[key] = gate(
                attn,
                CHECK_BATCH,
                s["heads"],
                n,
                s["head_dim"],
                s["dtype"],
                self.device,
                causal=case.causal,
                backward=backward,
            )
        verdict = self._gates[key]
        if not verdict["ok"]:
            pytest.fail(f"{case.variant} failed the correctness gate, not timed: {verdict['message']}", pytrace=False)
        return attn

    def _cell(self, case: Case) -> tuple[RunConfig, Cell]:
        """The case as bench run's planner sees it, so budgets and FLOPs come from the same code."""
        s = self.s
        config = RunConfig(
            variants=(case.name,),
            lengths=(case.n,),
            devices=(s["device"],),
            passes=(case.pass_,),
            causal=(case.causal,),
            batch=s["batch"],
            heads=s["heads"],
            head_dim=s["head_dim"],
            dtype=s["dtype"],
        )
        return config, Cell(s["device"], case.name, case.pass_, case.causal, case.n)

    def flops(self, case: Case, attn) -> float:
        return useful_flops(*self._cell(case), attn)

    def inputs(self, case: Case):
        s = self.s
        return make_inputs(
            s["batch"], s["heads"], case.n, s["head_dim"], s["dtype"], self.device, case.pass_ == "fwdbwd"
        )
