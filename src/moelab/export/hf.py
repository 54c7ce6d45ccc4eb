"""`moelab export hf` and `moelab export safetensors`: a run's checkpoint for other tools.

``export_hf`` writes a directory that Hugging Face transformers loads with
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``: ``config.json``,
``generation_config.json``, ``model.safetensors`` (fp32, PyTorch names and [out, in] linear
weights), ``tokenizer.json`` and ``tokenizer_config.json`` (a ``PreTrainedTokenizerFast``, with the
run's chat template: its tokenizer's, else moelab's own, ``moelab.data.chat``), and the
architecture's two files (``configuration_moelab.py``, ``modeling_moelab.py``, copied from
moelab/export/remote_code/). A global layer's k and v weights are written as that layer uses them (its kv
heads averaged from the allocated ones, ``layers.group_kv``), so the PyTorch side needs no rule. The
model takes padded batches with an ``attention_mask`` (left or right padding) and ``generate()``
keeps a KV cache; the config's ``rope_scaling`` carries the run's RoPE scaling (``_rope_scaling``).

``export_safetensors`` writes the weights alone under moelab's own names (``SAFETENSORS_NAMES``).

Both write to a temporary sibling and rename it into place when complete: an interrupted export
leaves no output that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from moelab.config import final_model, rope_scaling_of, to_dict
from moelab.data.chat import ChatTemplate
from moelab.errors import UsageError
from moelab.export import Trained, load_trained
from moelab.model.hf_layout import WEIGHTS, shape_fields, to_hf
from moelab.paths import writable_place

HERE = Path(__file__).parent / "remote_code"
EOT = "<|endoftext|>"

SAFETENSORS_NAMES = {
    "embed": "[vocab, d] token embeddings",
    "head": "[d, vocab] the output projection (logits = final_norm(x) @ head)",
    "final_norm": "[d] the final RMSNorm's weight",
    "router_bias": "[layers, experts] each layer's router bias (picks experts; not a gate)",
    "layers.NAME": "every per-layer weight stacked on a leading [layers] axis, as x @ w: attn_norm, wq "
    "[d, heads*hd], wk and wv [d, kv_alloc*hd], wo, mlp_norm, router [d, experts], w_gate and w_up "
    "[experts, din, f], w_down [experts, f, din], latent_down/latent_norm/latent_up (latent models), "
    "shared_gate/shared_up/shared_down (shared experts)",
}


def check_out(out: Path, is_dir: bool) -> None:
    """``--out`` is new (or an empty directory); missing parent folders are made once the export
    starts writing, as `moelab train` makes its --out's (a file in their place is refused)."""
    if out.exists() and (not is_dir or not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out}: already exists; choose a new {'directory' if is_dir else 'file'} or remove it")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"--out {out}: {parent} is a file, not a folder")
    writable_place(out)  # a folder it may not write in: refused before the checkpoint is loaded


def _np(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32))


def hf_tensors(t: Trained) -> dict[str, np.ndarray]:
    """PyTorch names (modeling_moelab.py's modules), linear weights as [out, in] (``model.hf_layout``)."""
    out = to_hf(t.params, t.model_state["router_bias"], t.cfg.model)
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in out.items()}


def _rope_scaling(t: Trained) -> dict:
    """The RoPE the model ends its run with (its last phase's: ``final_model``), as the export's config
    says it: {"type": none|pi|ntk|yarn, "factor": s, "original_max_position_embeddings": L0}."""
    kind, factor, base = rope_scaling_of(final_model(t.cfg))
    return {"type": str(kind), "factor": float(factor), "original_max_position_embeddings": int(base)}


def hf_config(t: Trained, eot: int | None) -> dict:
    m = t.cfg.model
    windows = [0 if m.is_global(i) or not m.sliding_window else m.sliding_window for i in range(m.n_layers)]
    return {
        "architectures": ["MoelabForCausalLM"],
        "model_type": "moelab",
        "auto_map": {
            "AutoConfig": "configuration_moelab.MoelabConfig",
            "AutoModelForCausalLM": "modeling_moelab.MoelabForCausalLM",
        },
        **shape_fields(m),  # the fields an import checks (model.hf_layout)
        "layer_windows": windows,
        "rope_fraction": m.rope_fraction,
        "rope_theta": m.rope_theta,
        "rope_scaling": _rope_scaling(t),
        "rms_norm_eps": m.norm_eps,
        "num_experts_per_tok": m.top_k,
        "router": m.router,
        "routed_scale": m.routed_scale if m.router == "sigmoid" else 1.0,
        "max_position_embeddings": final_model(t.cfg).seq_len,  # the last phase's context
        "tie_word_embeddings": False,
        "eos_token_id": eot,
        "torch_dtype": "float32",
        "moelab_step": t.step,
    }


def _eot(tokenizer_path: Path) -> int | None:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_path)).token_to_id(EOT)


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None, progress: bool = True) -> dict:
    from safetensors.numpy import save_file

    out = Path(out)
    check_out(out, is_dir=True)
    t = load_trained(run_dir, step, progress)
    eot = _eot(t.tokenizer_path)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    writable_place(out, make=True)  # the run and checkpoint are found: now something is written
    tmp.mkdir()
    try:
        tensors = hf_tensors(t)
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS, 0o644)
        (tmp / "config.json").write_text(json.dumps(hf_config(t, eot), indent=1))
        gen = {"eos_token_id": eot, "pad_token_id": eot, "use_cache": True}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1))
        shutil.copyfile(t.tokenizer_path, tmp / "tokenizer.json")
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": final_model(t.cfg).seq_len,
                   "clean_up_tokenization_spaces": False}  # fmt: skip
        if eot is not None:
            tok_cfg.update(eos_token=EOT, pad_token=EOT)
        # the run's chat template (its tokenizer's, else moelab's own), so apply_chat_template renders as moelab does
        chat = ChatTemplate.for_tokenizer(t.cfg.data.tokenizer)
        tok_cfg["chat_template"] = chat.source
        tok_cfg.update({k: v for k, v in chat.special.items() if k not in tok_cfg and k != "pad_token"})
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
        for name in ("configuration_moelab.py", "modeling_moelab.py"):
            shutil.copyfile(HERE / name, tmp / name)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(int(v.size) for v in tensors.values())
    return {"out": str(out), "step": t.step, "tensors": len(tensors), "params": n}


def export_safetensors(run_dir: str | Path, out: str | Path, step: int | None = None, progress: bool = True) -> dict:
    from safetensors.numpy import save_file

    out = Path(out)
    check_out(out, is_dir=False)
    t = load_trained(run_dir, step, progress)
    tensors = {"embed": _np(t.params["embed"]), "head": _np(t.params["head"]), "final_norm": _np(t.params["final_norm"]),
               "router_bias": _np(t.model_state["router_bias"])}  # fmt: skip
    tensors.update({f"layers.{k}": _np(v) for k, v in t.params["layers"].items()})
    meta = {"format": "moelab", "step": str(t.step), "config": json.dumps(to_dict(t.cfg))}
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    writable_place(out, make=True)
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {
        "out": str(out),
        "step": t.step,
        "tensors": len(tensors),
        "params": sum(int(v.size) for v in tensors.values()),
    }
