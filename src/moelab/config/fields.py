"""What the config's fields are made of: each field's meaning (``_f``), and the fixed sets of values
that some fields take, shared by the schema, its checks and `moelab config --explain`."""

from __future__ import annotations

from dataclasses import field
from typing import Any

ROUTERS = ("softmax", "sigmoid")
BIAS_UPDATES = ("none", "quantile", "sign")
DISPATCHES = ("dropless", "capacity", "spill")
MOE_IMPLS = ("auto", "ragged", "blocks", "loop")
ATTENTION_IMPLS = ("auto", "blocked", "flash", "xla", "cudnn")
SCAN_LAYERS = ("auto", "scan", "unrolled")
DROP_ORDERS = ("position", "score")
DTYPES = ("auto", "float32", "bfloat16")
OFFLOADS = ("none", "optimizer", "layer_inputs", "all")
CKPT_WRITERS = ("thread", "process")  # train.checkpoint_writer
MATMUL_PRECISIONS = ("default", "high", "highest")
REMATS = ("none", "layer", "each_layer")
ROPE_SCALINGS = ("none", "pi", "ntk", "yarn")  # moelab.model.layers.rope_frequencies
EP_TRANSPORTS = ("fixed", "spill", "pooled_wave")  # moelab.parallel.ep
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("linear", "wsd", "constant")

BYTE_LEVEL_BASE = 257  # a byte-level BPE's first tokens: 256 bytes and end-of-text


def _f(default: Any, meaning: str, choices: tuple = ()) -> Any:
    """A config field with its meaning, and its allowed values where they are a fixed set: the one
    source of `moelab config --explain` and the generated reference (``explain``). Metadata enters no
    comparison, no ``to_dict`` and no hash."""
    meta = {"help": meaning, **({"choices": tuple(choices)} if choices else {})}
    return field(default=default, metadata=meta)
