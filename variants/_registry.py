"""The registry: `register` (a method file's class decorator), `build` by name, and each variant's options
read from its `__init__` signatures and their `Args:` docstrings, and checked against a selection."""

from __future__ import annotations

import inspect
import re

import torch

from ._variant import AttentionVariant

_REGISTRY: dict[str, type[AttentionVariant]] = {}


def register(cls: type[AttentionVariant]) -> type[AttentionVariant]:
    """Class decorator: make `cls` available under `cls.spec.name`."""
    name = cls.spec.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"a variant named {name!r} is already registered ({_REGISTRY[name].__qualname__})")
    _REGISTRY[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a registered variant (for test-only variants)."""
    _REGISTRY.pop(name, None)


def available() -> list[str]:
    """Sorted names of every registered variant (whether or not it runs on this machine)."""
    return sorted(_REGISTRY)


def baseline() -> str:
    """The registered variant every other is compared with: the one whose spec says `baseline`."""
    named = [name for name in available() if _REGISTRY[name].spec.baseline]
    if len(named) != 1:
        raise ValueError(
            f"exactly one registered variant must be the baseline (spec.baseline); found {named or 'none'}"
        )
    return named[0]


def variant_class(name: str) -> type[AttentionVariant]:
    """The class registered as `name`; ValueError listing the registered names otherwise."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name]


def build(name: str, *, device: str | torch.device | None = None, **options) -> AttentionVariant:
    """Build the variant registered as `name`, with its options, on `device`.

    With a device, the variant must run there; without one (the module's parameters, if any, are
    on the CPU until it is moved), it must run on at least one of its devices on this machine, and
    each call checks the device of its inputs. On the "meta" device it is built for its shapes
    only: parameters without storage, nothing computed (what a planner reads FLOPs and memory from).

    Example:
        >>> attn = build("full")
        >>> q = k = v = torch.randn(1, 2, 16, 8)
        >>> attn(q, k, v, causal=True).shape
        torch.Size([1, 2, 16, 8])
    """
    cls = variant_class(name)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "meta":  # (built inside the device: a huge option allocates nothing)
        with dev:
            return cls(**options)
    reasons = [cls.unavailable_reason(d) for d in ((dev.type,) if dev is not None else cls.spec.devices)]
    if all(reasons):
        raise RuntimeError(f"variant {name!r} is unavailable: {'; '.join(reasons)}")
    try:
        module = cls(**options)
    except TypeError as err:
        allowed = _option_names(cls)
        raise TypeError(
            f"{name}: invalid options {sorted(options)}: {err}; allowed options: {', '.join(allowed)}"
        ) from None
    return module.to(dev) if dev is not None else module


def _option_defaults(cls: type) -> dict[str, object]:

    defaults: dict[str, object] = {}
    for klass in cls.__mro__:  # subclass options first, then the shared ones (scale, num_heads, head_dim)
        if "__init__" in vars(klass) and issubclass(klass, AttentionVariant):
            for p, param in inspect.signature(klass.__init__).parameters.items():
                if param.kind is param.KEYWORD_ONLY and p not in defaults:
                    defaults[p] = param.default
    return defaults


def _option_names(cls: type) -> list[str]:
    return list(_option_defaults(cls))


def options_taken(name: str, options: dict) -> dict:
    """What variant `name` takes of a run's options: the shared ones it accepts (window, compression, ...),
    and those scoped to it as 'name.option' (linformer.max_len), which win over a shared one."""
    accepted = set(option_names(name))
    shared = {key: value for key, value in options.items() if key in accepted}
    scoped = {key.partition(".")[2]: value for key, value in options.items() if key.partition(".")[0] == name}
    return {**shared, **{key: value for key, value in scoped.items() if key in accepted}}


def effective_options(name: str, **given) -> dict[str, object]:
    """Every option of variant `name` with the value it would run with: `given`, else its default."""
    return {**_option_defaults(variant_class(name)), **given}


def option_docs(name: str) -> dict[str, str]:
    """Each option of variant `name` with its description, read from the `Args:` sections of the
    `__init__` docstrings along its classes (the variant's own first); "" where none documents it."""
    docs: dict[str, str] = {}
    for klass in variant_class(name).__mro__:
        init = vars(klass).get("__init__")
        if init is None or not issubclass(klass, AttentionVariant):
            continue
        for option, text in _args_section(init.__doc__ or "").items():
            docs.setdefault(option, text)
    return {option: docs.get(option, "") for option in option_names(name)}


def _args_section(doc: str) -> dict[str, str]:
    """{'window': 'w, the band...'} from a Google-style `Args:` section (continuation lines joined)."""
    lines = inspect.cleandoc(doc).splitlines()
    found: dict[str, str] = {}
    current = None
    inside = False
    for line in lines:
        if line.strip() == "Args:":
            inside, current = True, None
            continue
        if not inside:
            continue
        match = re.match(r"^\s{4}(\w+)\s*(?:\(.*?\))?:\s*(.*)$", line)
        if match:
            current = match.group(1)
            found[current] = match.group(2).strip()
        elif line.startswith(" " * 8) and current:
            found[current] += " " + line.strip()
        elif line.strip() == "" or not line.startswith(" "):
            inside = line.strip() == "" and inside
            current = None
    return found


def option_names(name: str) -> list[str]:
    """The keyword options the variant `name` accepts."""
    return _option_names(variant_class(name))


def check_variant_options(name: str, options: dict, label: str, num_heads: int = 1, head_dim: int = 1) -> None:
    """ValueError (prefixed by `label`) unless variant `name` accepts `options` with these shape hints."""
    try:
        build(name, device="meta", **options, num_heads=num_heads, head_dim=head_dim)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{label}: {err}") from None


def check_options(options: dict, names: tuple[str, ...], num_heads: int = 1, head_dim: int = 1) -> None:
    """ValueError unless every option is taken by at least one of the variants `names`, and valid for each
    that takes it at this shape (an option bounded by the head dim, as feature_dim, is checked against it);
    one scoped to a variant ('linformer.max_len') by that variant, which must be among `names`."""
    for key, value in options.items():
        target, scoped, option = key.rpartition(".")
        if scoped:
            if target not in names:
                raise ValueError(
                    f"option {key}={value!r} is for {target}, which is not among the selected variants "
                    f"({', '.join(names)})"
                )
            if option not in option_names(target):
                raise ValueError(
                    f"option {key}={value!r}: {target} takes no option {option!r}; it takes: "
                    f"{', '.join(option_names(target)) or 'none'}"
                )
            check_variant_options(target, {option: value}, f"option {key}={value!r}", num_heads, head_dim)
            continue
        takers = [name for name in names if key in option_names(name)]
        if not takers:
            raise ValueError(f"option {key}={value!r} is taken by none of the selected variants ({', '.join(names)})")
        for name in takers:
            check_variant_options(name, {key: value}, f"option {key}={value!r}", num_heads, head_dim)
