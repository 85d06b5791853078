"""A variant's own parameters in a checkpoint saved after `use`.

A variant with parameters (memory_compressed) gets one module per attention layer, attached to it as
`attnbench_attention`: its parameters are in `model.parameters()`, trained, and saved by `save_pretrained`;
`use` on a model loaded from such a checkpoint restores them (found by their keys).
"""

from __future__ import annotations

import json
import os

from .layers import ATTRIBUTE


def _load_saved_variant_weights(model) -> None:
    """Load the attached variants' parameters from the checkpoint the model was loaded from, if it holds them.

    `save_pretrained` saves them with the model; `from_pretrained` builds the model before `use` attaches
    the variants, so it drops them as unexpected keys. This puts them back.
    """
    wanted = {name: p for name, p in model.state_dict().items() if f".{ATTRIBUTE}." in name}
    folder = getattr(model, "name_or_path", "") or ""
    if not wanted or not os.path.isdir(folder):
        return
    from safetensors import safe_open

    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as handle:
            files = sorted({os.path.join(folder, f) for f in json.load(handle)["weight_map"].values()})
    found = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                short = _strip_prefix(key, wanted)
                if short is not None:
                    found[short] = handle.get_tensor(key)
    if not found:
        return
    mismatched = [key for key, tensor in found.items() if tuple(tensor.shape) != tuple(wanted[key].shape)]
    if mismatched:
        raise ValueError(
            f"variants.hf.use: the checkpoint in {folder} holds attnbench parameters of other shapes "
            f"({mismatched[0]}: {tuple(found[mismatched[0]].shape)} vs {tuple(wanted[mismatched[0]].shape)}): "
            f"saved with another variant or options"
        )
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(
            f"variants.hf.use: the checkpoint in {folder} holds some attnbench parameters but not {missing[0]}"
        )
    model.load_state_dict(found, strict=False)


def _strip_prefix(key: str, wanted: dict) -> str | None:
    """The model's own name for a checkpoint key (checkpoints may add or drop the base-model prefix)."""
    if key in wanted:
        return key
    for name in wanted:
        if name.endswith("." + key) or key.endswith("." + name):
            return name
    return None
