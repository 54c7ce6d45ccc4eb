"""A config's plain data and its hash: ``to_dict``, ``config_hash`` (the identity a run, a checkpoint
and the lab record) and the compatibility table of fields added later, which keep old hashes valid."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from moelab.config.schema import Config


def to_dict(cfg: Config) -> dict:
    """``cfg`` as nested dicts, as it is printed, saved and hashed (the data sources, validation, mixture
    and phase starts as lists)."""
    out = dataclasses.asdict(cfg)
    for key in ("sources", "validation", "mixture", "phase_starts"):
        value = out["data"][key]
        out["data"][key] = {k: list(v) for k, v in value.items()} if isinstance(value, dict) else list(value)
    return out


# fields added after runs were recorded: at these values they leave a config's hash as it was
HASH_NEUTRAL = {
    ("mesh", "fsdp"): True,
    ("model", "moe_impl"): "auto",
    ("train", "keep_steps"): (),
    ("train", "lr_scale"): 1.0,
    ("train", "data_seed"): -1,  # the data order follows train.seed, as before the field existed
    ("train", "trackers"): (),  # where the metrics are mirrored changes nothing the run computes
    ("train", "tracker_project"): "",
    ("train", "tracker_entity"): "",
    ("train", "tracker_mode"): "",
    ("model", "matmul_precision"): "default",  # what JAX did before the field existed
    ("data", "validation"): [],  # evaluated, never trained on: what a run computes otherwise is unchanged
    ("data", "bad_records"): "refuse",
    ("data", "workers"): 0,  # the token store's bytes are the same whatever the workers
    ("data", "backend"): "local",
    ("train", "micro_batch"): 0,
    ("train", "offload"): "none",  # where the state lives changes no number (tested equal)
    ("train", "async_checkpoint"): True,
    ("train", "checkpoint_dir"): "",
    ("data", "phase_seq_lens"): [],
    ("model", "rope_scaling"): "ntk",  # no effect without a longer context than RoPE's original
    ("model", "rope_original_len"): 0,
    ("train", "init_from"): "",  # from the seed, as every run before the field
    ("train", "task_eval_samples"): 1,  # never hashed (below); neutral for the lab's step identities
    ("data", "packing"): "packed",  # documents end to end, as every run before the field
    ("train", "failure_hours"): 0.0,  # advice printed, nothing computed changes (never hashed, below)
    ("train", "checkpoint_writer"): "thread",  # who writes the same checkpoint (never hashed, below)
}  # spill_choices changes what spill does: it is hashed
# of those, the fields added after the lab's step identities were recorded (moelab.lab.steps): at their
# neutral value they leave out of a step's identity too, so a finished step is still found
LAB_NEUTRAL = {
    ("train", "data_seed"), ("train", "init_from"), ("train", "task_eval_samples"), ("data", "packing"),
    ("train", "failure_hours"), ("train", "checkpoint_writer"),
}  # fmt: skip
# fields never hashed: what is evaluated beside the loss changes nothing a run trains
NEVER_HASHED = {
    ("train", "task_evals"), ("train", "task_eval_examples"), ("train", "task_eval_samples"), ("train", "failure_hours"),
    ("train", "checkpoint_writer"),
}  # fmt: skip


def step_dict(cfg: Config) -> dict:
    """``cfg`` as a lab step's identity holds it: ``to_dict`` without the LAB_NEUTRAL fields at their
    neutral values."""
    return _without_neutral(to_dict(cfg), LAB_NEUTRAL)


def _without_neutral(data: dict, keys) -> dict:
    """``data`` (a config's dict) without the HASH_NEUTRAL ``keys`` that hold their neutral value."""
    for section, key in keys:
        if data.get(section, {}).get(key, HASH_NEUTRAL[(section, key)]) == HASH_NEUTRAL[(section, key)]:
            data.get(section, {}).pop(key, None)
    return data


def config_hash(cfg: Config) -> str:
    """A config's identity: 12 hex digits of the sha256 of its sorted JSON, without the HASH_NEUTRAL fields
    at their neutral values and without the NEVER_HASHED fields."""
    data = _without_neutral(to_dict(cfg), HASH_NEUTRAL)
    for section, key in NEVER_HASHED:
        data.get(section, {}).pop(key, None)
    blob = json.dumps(data, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def changed_fields(old: dict, new: dict) -> list[str]:
    """The hashed fields (``section.key``, or a top-level key) whose values differ between two configs'
    dicts (as ``to_dict`` writes them, or read back from JSON); a field one of them lacks counts at its
    HASH_NEUTRAL value, and NEVER_HASHED fields are left out."""
    old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))  # tuples as lists, as a file holds them
    out = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        if not (isinstance(a, dict) or isinstance(b, dict)):
            if a != b:
                out.append(section)
            continue
        a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
        for key in sorted(set(a) | set(b)):
            if (section, key) in NEVER_HASHED:
                continue
            neutral = json.loads(json.dumps(HASH_NEUTRAL.get((section, key))))
            if a.get(key, neutral) != b.get(key, neutral):
                out.append(f"{section}.{key}")
    return out
