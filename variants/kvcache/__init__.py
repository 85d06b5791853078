"""Training-free KV-cache policies: after an exact prefill, keep a budget of the prompt's positions per K/V
head, chosen by a score; decoding then reads only the kept keys and values (one file a policy).

    from variants import kvcache
    kvcache.available()                                   # the policies' names
    policy = kvcache.build("snapkv", window_size=64)
    index = policy.keep(prompt, ratio=0.5)                # (B, Hkv, n_kept): a kvcache.Prompt of one layer

A registry of their own beside the variants': a policy is not an attention of (q, k, v) -> out (its prefill
is exact softmax and it has no gradient to check); what it changes is the cache a decoder keeps.
"""

import importlib
import inspect

from ._policy import KVPolicy, Prompt, attend, check_ratio, gathered, n_kept, reference_attend

POLICIES = ("expected_attention", "h2o", "knorm", "pyramidkv", "random", "snapkv", "streaming_llm", "tova")


def available() -> list[str]:
    """The policies' names, sorted."""
    return list(POLICIES)


def policy_module(name: str):
    """The file that defines policy `name` (its class `POLICY`, its `reference_scores`)."""
    if name not in POLICIES:
        raise ValueError(f"unknown KV-cache policy {name!r}; available: {', '.join(POLICIES)}")
    return importlib.import_module(f"{__name__}.{name}")


def build(name: str, **options) -> KVPolicy:
    """The policy `name` with its options; ValueError naming an unknown name or option."""
    cls = policy_module(name).POLICY
    try:
        return cls(**options)
    except TypeError:
        allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        raise ValueError(
            f"{name}: options {', '.join(sorted(options))} not all taken; it takes {', '.join(allowed) or 'none'}"
        ) from None


__all__ = [
    "KVPolicy",
    "POLICIES",
    "Prompt",
    "attend",
    "available",
    "build",
    "check_ratio",
    "gathered",
    "n_kept",
    "policy_module",
    "reference_attend",
]
