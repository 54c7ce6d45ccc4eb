"""Ladder plans: one recipe, several widths, everything else by rule.

A ladder forecasts only when its rungs share one recipe: a fixed head dimension (heads =
d / head_dim), depth and kv heads by rule, the same data and mixture, and the same tokens per
active parameter (or one compute budget each). `moelab ladder plan LADDER.yaml` prints the rungs.

    recipe: tiny                  # a preset or a config YAML, the shared recipe
    overrides: [train.lr=auto]    # applied to every rung
    widths: [64, 96, 128]
    head_dim: 32
    layers: [2, 3, 4]             # one per width (or one for all), or a number: layers = round(d * number)
    kv_local_divisor: 2           # kv heads of local layers = max(1, heads // this)
    kv_global_divisor: 4          # kv heads of global layers = max(1, heads // this)
    expert_ratio: 0.5             # expert, latent and shared widths = d * this
    batch_size: 16                # sequences per step: one number, or one per width
    tokens_per_active_param: 791  # or budget_flops: training FLOPs per rung
    target_width: 96              # optional: the run the ladder forecasts, by the same rules
                                  # (layers and batch_size lists may give it one more entry)
    seeds: 2                      # runs per rung, seeds 0, 1, ...: the band needs the spread between
                                  # runs known with 3 degrees of freedom (independent runs minus 2)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from moelab import accounting
from moelab.config import Config, ConfigError, load_config

FIELDS = ("recipe", "overrides", "widths", "head_dim", "layers", "kv_local_divisor", "kv_global_divisor",
          "expert_ratio", "batch_size", "tokens_per_active_param", "budget_flops", "name", "target_width",
          "seeds", "top_seeds")  # fmt: skip


@dataclass(frozen=True)
class Ladder:
    recipe: str
    widths: tuple[int, ...]
    head_dim: int
    layers: tuple[int, ...] | float
    kv_local_divisor: int = 4
    kv_global_divisor: int = 8
    expert_ratio: float = 0.5
    batch_size: tuple[int, ...] | int = 16
    tokens_per_active_param: float = 0.0
    budget_flops: float = 0.0
    overrides: tuple[str, ...] = ()
    name: str = "ladder"
    target_width: int = 0  # 0 = none: the target is given elsewhere (a preset or config)
    seeds: int = 1  # runs per rung (train.seed 0, 1, ...); the target runs once
    top_seeds: int = 0  # runs of the widest rung, when more than seeds (the forecast leans on it most); 0 = seeds

    def all_widths(self) -> tuple[int, ...]:
        """The rungs' widths, then the target's when the ladder names one."""
        return self.widths + ((self.target_width,) if self.target_width else ())


def load_ladder(path: str | Path) -> Ladder:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: no such ladder file"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError([f"{path}: not UTF-8 text; save the ladder as UTF-8"]) from None
    except yaml.YAMLError:
        raise ConfigError([f"{path}: is not valid YAML; fix the syntax"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of ladder fields, got {type(data).__name__}"])
    errors = [f"{path}: {k}: unknown key (known: {', '.join(FIELDS)})" for k in data if k not in FIELDS]
    for key in ("recipe", "widths", "head_dim", "layers"):
        if key not in data:
            errors.append(f"{path}: {key}: missing")
    if errors:
        raise ConfigError(errors)
    for key, kind in (("widths", int), ("head_dim", int), ("layers", float), ("batch_size", int),
                      ("kv_local_divisor", int), ("kv_global_divisor", int), ("expert_ratio", float),
                      ("tokens_per_active_param", float), ("budget_flops", float), ("target_width", int),
                      ("seeds", int), ("top_seeds", int)):  # fmt: skip
        value = data.get(key)
        values = value if isinstance(value, list) else [value]
        if key == "widths" and not (isinstance(value, list) and value):
            raise ConfigError([f"{path}: widths: a list of model widths (at least one), got {value!r}"])
        for v in values:
            if v is None and key not in ("widths", "head_dim", "layers"):
                continue
            try:
                kind(v)
            except (TypeError, ValueError):
                raise ConfigError([f"{path}: {key}: {v!r} is not a number"]) from None
    widths = tuple(int(w) for w in data["widths"])
    layers = data["layers"]
    layers = tuple(int(x) for x in layers) if isinstance(layers, list) else float(layers)
    batch = data.get("batch_size", 16)
    batch = tuple(int(x) for x in batch) if isinstance(batch, list) else int(batch)
    ladder = Ladder(
        recipe=str(data["recipe"]), widths=widths, head_dim=int(data["head_dim"]), layers=layers,
        kv_local_divisor=int(data.get("kv_local_divisor", 4)), kv_global_divisor=int(data.get("kv_global_divisor", 8)),
        expert_ratio=float(data.get("expert_ratio", 0.5)), batch_size=batch,
        tokens_per_active_param=float(data.get("tokens_per_active_param", 0)),
        budget_flops=float(data.get("budget_flops", 0)), overrides=tuple(data.get("overrides", []) or ()),
        name=str(data.get("name", path.stem)), target_width=int(data.get("target_width", 0) or 0),
        seeds=int(data.get("seeds", 1)), top_seeds=int(data.get("top_seeds", 0) or 0),
    )  # fmt: skip
    if ladder.seeds < 1:
        errors.append(f"{path}: seeds: runs per rung must be >= 1, got {ladder.seeds}")
    if ladder.top_seeds and ladder.top_seeds < ladder.seeds:
        errors.append(
            f"{path}: top_seeds: {ladder.top_seeds} runs of the widest rung, fewer than seeds {ladder.seeds}; give 0 or more"
        )
    for key, value in (("layers", ladder.layers), ("batch_size", ladder.batch_size)):
        allowed = {1, len(widths), len(widths) + 1} if ladder.target_width else {1, len(widths)}
        if isinstance(value, tuple) and len(value) not in allowed:
            errors.append(f"{path}: {key}: {len(value)} values for {len(widths)} widths")
    if ladder.target_width and ladder.target_width <= max(widths):
        errors.append(f"{path}: target_width: {ladder.target_width} is not wider than the widest rung {max(widths)}")
    if ladder.target_width % ladder.head_dim:
        errors.append(f"{path}: target_width: {ladder.target_width} is not a multiple of head_dim {ladder.head_dim}")
    if bool(ladder.tokens_per_active_param) == bool(ladder.budget_flops):
        errors.append(f"{path}: tokens_per_active_param: give it or budget_flops, exactly one")
    for d in widths:
        if d % ladder.head_dim:
            errors.append(f"{path}: widths: {d} is not a multiple of head_dim {ladder.head_dim}")
    if errors:
        raise ConfigError(errors)
    return ladder


def _pick(value, i: int):
    return value[min(i, len(value) - 1)] if isinstance(value, tuple) else value


def rung_config(ladder: Ladder, i: int, steps: int | None = None) -> Config:
    """The recipe at width ``all_widths()[i]`` (the target's after the rungs), with heads, depth,
    kv heads, widths and batch by rule."""
    d = ladder.all_widths()[i]
    heads = d // ladder.head_dim
    layers = _pick(ladder.layers, i) if isinstance(ladder.layers, tuple) else max(1, round(d * ladder.layers))
    base = load_config(ladder.recipe, list(ladder.overrides))
    width = int(d * ladder.expert_ratio)
    rule = [
        f"model.d_model={d}", f"model.n_heads={heads}", f"model.head_dim={ladder.head_dim}", f"model.n_layers={layers}",
        f"model.n_kv_heads={max(1, heads // ladder.kv_global_divisor)}",
        f"model.n_kv_heads_local={max(1, heads // ladder.kv_local_divisor)}",
        f"model.expert_dim={width}", f"model.shared_dim={width}",
        f"train.batch_size={_pick(ladder.batch_size, i)}",
    ]  # fmt: skip
    if base.model.latent_dim:
        rule.append(f"model.latent_dim={width}")
    cfg = load_config(base, rule)
    if steps is None:
        a = accounting.count(cfg)
        tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        if ladder.tokens_per_active_param:
            tokens = ladder.tokens_per_active_param * a.active_params
        else:
            tokens = ladder.budget_flops / (3 * a.forward_flops_per_token)
        steps = max(1, math.ceil(tokens / tokens_per_step))
    return dataclasses.replace(load_config(cfg, [f"train.steps={steps}"]), name=f"{ladder.name}-d{d}")


def rung_runs(ladder: Ladder) -> list[tuple[str, Config]]:
    """Every rung run: (name, config) per width and seed (``-sK`` after the first seed's name)."""
    out = []
    for i, d in enumerate(ladder.widths):
        cfg = rung_config(ladder, i)
        top = i == len(ladder.widths) - 1 and ladder.top_seeds
        for k in range(ladder.top_seeds if top else ladder.seeds):
            seeded = cfg if k == 0 else load_config(cfg, [f"train.seed={cfg.train.seed + k}"])
            out.append((f"{ladder.name}-d{d}" + (f"-s{k}" if k else ""), dataclasses.replace(seeded, name=cfg.name)))
    return out


def plan(ladder: Ladder, flops_per_s: float | None = None) -> list[dict]:
    rows = []
    for i, d in enumerate(ladder.all_widths()):
        cfg = rung_config(ladder, i)
        tokens = accounting.run_tokens(cfg)
        out = accounting.run_train(cfg)
        rows.append({
            "rung": f"d{d}" if i < len(ladder.widths) else f"d{d} (target)", "d_model": d, "n_layers": cfg.model.n_layers, "n_heads": cfg.model.n_heads,
            "kv_heads_local": cfg.model.kv_heads_local, "kv_heads_global": cfg.model.n_kv_heads,
            "batch_size": cfg.train.batch_size, "total_params": out["total_params"], "active_params": out["active_params"],
            "tokens": tokens, "steps": cfg.train.steps, "train_flops": out["train_flops"],
            "train_flops_without_lm_head": out["train_flops_without_lm_head"],
            "tokens_per_active_param": tokens / out["active_params"],
            "seconds": out["train_flops"] / flops_per_s if flops_per_s else None,
        })  # fmt: skip
    return rows
