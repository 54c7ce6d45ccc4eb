"""The model's weights in the Hugging Face layout that `moelab export hf` writes, both ways.

``to_hf`` names every weight as the exported PyTorch model (``export/remote_code/modeling_moelab.py``)
holds it: linear weights [out, in], each layer's router bias beside its router, and a global layer's k and
v weights as that layer uses them (its kv heads averaged from the allocated ones, ``layers.group_kv``).

``from_hf`` reads them back into moelab's parameters and router biases for a model of the same shapes
(``train.init_from = "hf:DIR"``). Everything but a global layer's k and v comes back exactly; those come
back as each averaged head repeated over its group of allocated heads, which the layer averages to the
same weights again: the model computes what the exported one computes.

``shape_fields`` are the config.json fields that fix the weights' shapes: an export whose fields differ
from a model's cannot start it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig
from moelab.model.layers import group_kv
from moelab.model.transformer import param_shapes

WEIGHTS = "model.safetensors"


def shape_fields(m: ModelConfig) -> dict:
    """The config.json fields of an export (``moelab.export.hf.hf_config``) that fix its weights' shapes."""
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "head_dim": m.head_size,
        "layer_kv_heads": [m.layer_kv_heads(i) for i in range(m.n_layers)],
        "n_routed_experts": m.n_routed,
        "moe_intermediate_size": m.expert_dim,
        "latent_dim": m.latent_dim,
        "shared_intermediate_size": m.n_shared * m.shared_dim,
    }


def _linear(name: str) -> bool:
    """A moelab layer weight that PyTorch holds as nn.Linear ([out, in]: transposed)."""
    return name in ("wq", "wk", "wv", "wo", "router", "latent_down", "latent_up") or name.startswith("shared_")


def _hf_name(name: str) -> str:
    """A per-layer weight's name under ``model.layers.I.``."""
    attn = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    if name in attn:
        return f"self_attn.{attn[name]}.weight"
    if name in ("attn_norm", "mlp_norm"):
        return name
    if name in ("w_gate", "w_up", "w_down"):
        return f"mlp.experts.{name}"
    if name == "latent_norm":
        return "mlp.latent_norm"
    return f"mlp.{name}.weight"  # router, latent_down/up, shared_gate/up/down


def to_hf(params: dict, router_bias, m: ModelConfig) -> dict:
    """Every weight under its exported name (float32; arrays of the input's kind, numpy or jax)."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    L = params["layers"]
    out = {"model.embed_tokens.weight": f32(params["embed"]), "model.norm": f32(params["final_norm"]),
           "lm_head.weight": f32(params["head"]).T}  # fmt: skip
    for i in range(m.n_layers):
        pre, kv = f"model.layers.{i}.", m.layer_kv_heads(i)
        for name in param_shapes(m)["layers"]:
            w = L[name][i]
            if name in ("wk", "wv"):
                w = group_kv(w, m.kv_heads_alloc, kv)
            w = f32(w)
            out[pre + _hf_name(name)] = w.T if _linear(name) else w
        out[pre + "mlp.router_bias"] = f32(router_bias[i])
    return out


def from_hf(tensors: dict, m: ModelConfig) -> tuple[dict, np.ndarray]:
    """(params, router biases [layers, experts]) of model ``m`` from an export's tensors (numpy, float32).
    ValueError naming the first tensor that is missing or of another shape; extra tensors are refused too."""
    shapes = param_shapes(m)
    want = {"model.embed_tokens.weight": shapes["embed"], "model.norm": shapes["final_norm"],
            "lm_head.weight": shapes["head"][::-1]}  # fmt: skip
    hd = m.head_size
    for i in range(m.n_layers):
        pre, kv = f"model.layers.{i}.", m.layer_kv_heads(i)
        for name, shape in shapes["layers"].items():
            s = shape[1:]
            if name in ("wk", "wv"):
                s = (s[0], kv * hd)
            want[pre + _hf_name(name)] = s[::-1] if _linear(name) else s
        want[pre + "mlp.router_bias"] = (m.n_routed,)
    for name, shape in want.items():
        if name not in tensors:
            raise ValueError(f"{name}: missing")
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{name}: shape {list(tensors[name].shape)}, this model's is {list(shape)}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise ValueError(f"{extra[0]}: not a weight of this model ({len(extra)} such)")
    t = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    layers = {}
    for name in shapes["layers"]:
        per = []
        for i in range(m.n_layers):
            w = t[f"model.layers.{i}." + _hf_name(name)]
            w = w.T if _linear(name) else w
            group = m.kv_heads_alloc // m.layer_kv_heads(i)
            if name in ("wk", "wv") and group > 1:  # each used head over its group of allocated ones
                w = np.repeat(w.reshape(w.shape[0], -1, hd), group, axis=1).reshape(w.shape[0], -1)
            per.append(w)
        layers[name] = np.stack(per)
    params = {"embed": t["model.embed_tokens.weight"], "layers": layers, "final_norm": t["model.norm"],
              "head": t["lm_head.weight"].T}  # fmt: skip
    bias = np.stack([t[f"model.layers.{i}.mlp.router_bias"] for i in range(m.n_layers)])
    return {k: np.ascontiguousarray(v) if not isinstance(v, dict) else v for k, v in params.items()}, bias
