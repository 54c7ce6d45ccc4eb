"""One frozen configuration per run: model, train, data and mesh sections.

Built from a preset name, a YAML file, a dict or Python, then ``--set a.b=value`` overrides,
and validated before any compute; every problem is one line that names its field.

The package, lowest first: ``faults`` (fault specs, as train.inject takes them), ``fields`` (a field's
meaning, the fixed sets of values), the sections ``model``, ``train`` and ``data``, ``schema`` (the
whole config, the mesh, the cross-section checks and the views derived from a config), ``hashing``
(plain data and the hash), ``meanings`` (`moelab config --explain`) and ``load`` (building a config
from presets, files, dicts and overrides). Every name is importable from ``moelab.config``.
"""

from __future__ import annotations

from moelab.config.data import DataConfig
from moelab.config.fields import (
    ATTENTION_IMPLS,
    BIAS_UPDATES,
    BYTE_LEVEL_BASE,
    DISPATCHES,
    DROP_ORDERS,
    DTYPES,
    EP_TRANSPORTS,
    MATMUL_PRECISIONS,
    MOE_IMPLS,
    OFFLOADS,
    OPTIMIZERS,
    REMATS,
    ROPE_SCALINGS,
    ROUTERS,
    SCAN_LAYERS,
    SCHEDULES,
)
from moelab.config.hashing import (
    HASH_NEUTRAL,
    LAB_NEUTRAL,
    NEVER_HASHED,
    changed_fields,
    config_hash,
    step_dict,
    to_dict,
)
from moelab.config.load import apply_overrides, config_from_dict, load_config, parse_override, replace
from moelab.config.meanings import explain, field_paths, show_value, summary, type_label
from moelab.config.model import ModelConfig, auto_dtype, rope_scaling_of
from moelab.config.schema import (
    SECTIONS,
    Config,
    MeshConfig,
    data_seed,
    final_model,
    phase_config,
    phase_seq_lens,
    resolve_dtype,
    validate,
)
from moelab.config.train import TrainConfig
from moelab.errors import ConfigError

__all__ = [
    "ATTENTION_IMPLS",
    "BIAS_UPDATES",
    "BYTE_LEVEL_BASE",
    "DISPATCHES",
    "DROP_ORDERS",
    "DTYPES",
    "EP_TRANSPORTS",
    "HASH_NEUTRAL",
    "LAB_NEUTRAL",
    "MATMUL_PRECISIONS",
    "MOE_IMPLS",
    "NEVER_HASHED",
    "changed_fields",
    "OFFLOADS",
    "OPTIMIZERS",
    "REMATS",
    "ROPE_SCALINGS",
    "ROUTERS",
    "SCAN_LAYERS",
    "SCHEDULES",
    "SECTIONS",
    "Config",
    "ConfigError",
    "DataConfig",
    "MeshConfig",
    "ModelConfig",
    "TrainConfig",
    "apply_overrides",
    "auto_dtype",
    "config_from_dict",
    "config_hash",
    "data_seed",
    "explain",
    "field_paths",
    "final_model",
    "load_config",
    "parse_override",
    "phase_config",
    "phase_seq_lens",
    "replace",
    "resolve_dtype",
    "rope_scaling_of",
    "show_value",
    "step_dict",
    "summary",
    "to_dict",
    "type_label",
    "validate",
]
