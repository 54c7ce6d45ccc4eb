"""Named configurations: Marin's 535B-A23B hero, its four ladder rungs, and tiny CPU models.

Shapes and step counts come from ``shared/reference/marin_hero.json`` (Marin issue #8435).
"""

from __future__ import annotations

from collections.abc import Callable

SEQ = 4096
WINDOW = 2048
VOCAB = 128256


def _marin(d: int, layers: int, heads: int, kv_local: int, kv_global: int, steps: int, batch: int) -> dict:
    """Marin's recipe at width d: head_dim 128, 384 experts top-8, expert = latent = shared = d/2."""
    return {
        "model": {
            "d_model": d,
            "n_layers": layers,
            "n_heads": heads,
            "head_dim": 128,
            "n_kv_heads": kv_global,
            "n_kv_heads_local": kv_local,
            "vocab_size": VOCAB,
            "seq_len": SEQ,
            "sliding_window": WINDOW,
            "global_every": 4,
            "n_routed": 384,
            "top_k": 8,
            "expert_dim": d // 2,
            "latent_dim": d // 2,
            "n_shared": 2,
            "shared_dim": d // 2,
            "router": "sigmoid",
            "bias_update": "quantile",
            "routed_scale": 2.5,
            "aux_loss_coef": 0.0,
            "logit_z_loss": 1e-4,
            "dispatch": "capacity",
            "eval_dispatch": "dropless",
            "capacity_factor": 1.15,
            "capacity_group": 0,  # each device's tokens are one group: Marin's grouping
            "compute_dtype": "bfloat16",
            # Marin's memory strategy (experiments/grug/moe_hero_ep): every layer rematerialised on its own
            # (its input kept), the loss over chunks of tokens (logits never whole), fused attention (auto: cuDNN
            # in bf16 on a GPU)
            "remat": "each_layer",
            "ce_chunk": 8192,
        },
        "train": {"steps": steps, "batch_size": batch, "lr": "auto", "warmup_frac": 0.01, "min_lr_ratio": 0.05},
    }


def _hero() -> dict:
    """The hero on GB200: also the optimizer state and each layer's input in the Grace CPU's memory
    (pinned host), as Marin runs it; 16 x 4,096 tokens per GPU on Marin's 11 x 64 mesh."""
    cfg = _marin(6144, 48, 48, 12, 6, steps=390251, batch=11264)
    cfg["train"]["offload"] = "all"
    return cfg


def _rung(d: int, layers: int, kv_local: int, kv_global: int, racks: int, steps: int) -> dict:
    # heads = d / 128 and 1024 sequences per rack, as in Marin's ladder
    return _marin(d, layers, d // 128, kv_local, kv_global, steps, 1024 * racks)


def _tiny() -> dict:
    """Every feature of the hero recipe at a size that trains on 2 CPU cores in well under a second a step."""
    return {
        "model": {
            "d_model": 128,
            "n_layers": 4,
            "n_heads": 4,
            "n_kv_heads": 1,
            "n_kv_heads_local": 2,
            "vocab_size": 2048,
            "seq_len": 128,
            "sliding_window": 64,
            "global_every": 2,
            "n_routed": 8,
            "top_k": 2,
            "expert_dim": 64,
            "latent_dim": 64,
            "n_shared": 1,
            "shared_dim": 64,
            "router": "sigmoid",
            "bias_update": "quantile",
            "routed_scale": 1.0,
            "aux_loss_coef": 0.0,
            "dispatch": "capacity",
            "eval_dispatch": "dropless",
            "capacity_factor": 1.25,
        },
        "train": {"steps": 300, "batch_size": 16, "lr": 3e-3},
    }


def _tiny_softmax() -> dict:
    """The tiny model with a softmax router, Switch aux loss and dropless dispatch, no window or latent."""
    cfg = _tiny()
    cfg["model"].update(
        router="softmax",
        bias_update="none",
        aux_loss_coef=0.01,
        dispatch="dropless",
        eval_dispatch="",
        latent_dim=0,
        sliding_window=0,
        n_kv_heads=2,
        n_kv_heads_local=0,
    )
    return cfg


PRESETS: dict[str, Callable[[], dict]] = {
    "marin-535b-a23b": lambda: _hero(),
    "marin-ladder-d768": lambda: _rung(768, 8, 1, 1, racks=1, steps=11420),
    "marin-ladder-d1024": lambda: _rung(1024, 12, 2, 1, racks=2, steps=15276),
    "marin-ladder-d1536": lambda: _rung(1536, 16, 3, 1, racks=6, steps=15128),
    "marin-ladder-d2048": lambda: _rung(2048, 22, 4, 2, racks=11, steps=20072),
    "tiny": _tiny,
    "tiny-softmax": _tiny_softmax,
}

# one line per preset: `moelab presets` and the generated configuration reference show it
ABOUT: dict[str, str] = {
    "marin-535b-a23b": "Marin's 535B-A23B hero: d 6144, 48 layers, 384 experts top-8; on GB200, optimizer state "
    "and layer inputs in host memory",
    "marin-ladder-d768": "Marin's ladder rung at d 768 (8 layers), 1 rack: the hero recipe, heads = d/128",
    "marin-ladder-d1024": "Marin's ladder rung at d 1024 (12 layers), 2 racks",
    "marin-ladder-d1536": "Marin's ladder rung at d 1536 (16 layers), 6 racks",
    "marin-ladder-d2048": "Marin's ladder rung at d 2048 (22 layers), 11 racks",
    "tiny": "Every feature of the hero recipe (sigmoid router, quantile bias, capacity dispatch, window, latent "
    "experts) at a size that trains on 2 CPU cores",
    "tiny-softmax": "The tiny model with a softmax router, Switch aux loss and dropless dispatch; no window or latent",
}

MARIN_LADDER = ("marin-ladder-d768", "marin-ladder-d1024", "marin-ladder-d1536", "marin-ladder-d2048")


def preset_dict(name: str) -> dict:
    data = PRESETS[name]()
    data["name"] = name
    return data


# `moelab bench train-step`'s shape flags (moelab.bench): flag -> (config field, type, default), over
# DEFAULT_PRESET's recipe (reference shape A); plain data, so the command line's parser loads nothing heavy
SHAPE_FLAGS = {
    # flag: (config field, type, default)
    "d_model": ("model.d_model", int, 256),
    "layers": ("model.n_layers", int, 4),
    "heads": ("model.n_heads", int, 8),
    "kv_heads": ("model.n_kv_heads", int, 0),  # 0 = heads
    "experts": ("model.n_routed", int, 16),
    "top_k": ("model.top_k", int, 4),
    "expert_dim": ("model.expert_dim", int, 128),
    "shared": ("model.n_shared", int, 1),
    "shared_dim": ("model.shared_dim", int, 256),
    "latent_dim": ("model.latent_dim", int, 0),
    "seq": ("model.seq_len", int, 256),
    "batch": ("train.batch_size", int, 8),
    "vocab": ("model.vocab_size", int, 4096),
    "dispatch": ("model.dispatch", str, "dropless"),
    "capacity_factor": ("model.capacity_factor", float, 1.25),
    "dtype": ("model.compute_dtype", str, "float32"),
    "remat": ("model.remat", str, "none"),
    "ce_chunk": ("model.ce_chunk", int, 0),
}
DEFAULT_PRESET = "tiny-softmax"
