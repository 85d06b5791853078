"""The attention methods, one file each; `variants` imports every file here, and each registers itself.

A new method is one more file: an `AttentionVariant` subclass with its `spec`, `_attend`, `flops` and
(where it is not exact softmax attention) `reference`, decorated with `@register`.
"""
