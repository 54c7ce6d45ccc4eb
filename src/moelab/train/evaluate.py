"""Held-out evaluation: loss and bits per byte per domain and their macro average, as trained and dropless.

Each domain is evaluated on the same windows every time: consecutive, non-overlapping windows
from the start of its held-out stream, up to ``train.eval_tokens`` target tokens.
"""

from __future__ import annotations

import math

import numpy as np

from moelab.config import Config
from moelab.data.store import TokenStore


def eval_windows(store: TokenStore, domain: str, seq_len: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [n, seq_len + 1] and a mask [n, seq_len] of the targets that count."""
    stream = np.asarray(store.stream(domain, "heldout"), np.int32)
    n_full = min(max(max_tokens // seq_len, 1), (len(stream) - 1) // seq_len)
    rows, masks = [], []
    for i in range(n_full):
        rows.append(stream[i * seq_len : i * seq_len + seq_len + 1])
        masks.append(np.ones(seq_len, np.float32))
    if n_full == 0:  # a held-out stream shorter than one window: one padded row
        row = np.full(seq_len + 1, store.eot, np.int32)
        row[: len(stream)] = stream
        mask = np.zeros(seq_len, np.float32)
        mask[: len(stream) - 1] = 1.0
        rows.append(row)
        masks.append(mask)
    return np.stack(rows), np.stack(masks)


class Evaluator:
    def __init__(self, cfg: Config, store: TokenStore):
        from moelab.train.step import make_eval_step

        self.cfg = cfg
        self.fn = make_eval_step(cfg)
        m = cfg.model
        # as trained (the training dispatch, with its drops) and dropless
        self.dispatches = {"": m.dispatch, "_dropless": "dropless"}
        b = cfg.train.batch_size
        self.data = {}
        for domain in store.domains:
            rows, mask = eval_windows(store, domain, m.seq_len, cfg.train.eval_tokens)
            n_bytes = float(np.sum(store.byte_lengths[np.clip(rows[:, 1:], 0, len(store.byte_lengths) - 1)] * mask))
            pad = (-len(rows)) % b
            if pad:
                rows = np.concatenate([rows, np.repeat(rows[-1:], pad, 0)])
                mask = np.concatenate([mask, np.zeros((pad, m.seq_len), np.float32)])
            self.data[domain] = (rows.reshape(-1, b, m.seq_len + 1), mask.reshape(-1, b, m.seq_len), n_bytes)

    def __call__(self, params, model_state) -> dict:
        out: dict = {}
        for suffix, dispatch in self.dispatches.items():
            if suffix and dispatch == self.dispatches[""]:  # trained dropless: the same numbers
                out[f"loss{suffix}"], out[f"bpb{suffix}"] = out["loss"], out["bpb"]
                continue
            losses, bpbs = {}, {}
            for domain, (rows, mask, n_bytes) in self.data.items():
                total, count = 0.0, 0.0
                for r, mk in zip(rows, mask, strict=True):
                    s, c = self.fn(params, model_state, r[:, :-1], r[:, 1:], mk, dispatch=dispatch)
                    total += float(s)
                    count += float(c)
                losses[domain] = total / max(count, 1.0)
                bpbs[domain] = total / math.log(2) / max(n_bytes, 1.0)
            losses["macro"] = float(np.mean([losses[d] for d in self.data]))
            bpbs["macro"] = float(np.mean([bpbs[d] for d in self.data]))
            out[f"loss{suffix}"] = losses
            out[f"bpb{suffix}"] = bpbs
        return out


def evaluate_run(run_dir, step: int | None = None, progress: bool = True) -> dict:
    """`moelab eval`: evaluate a run's newest (or a given) checkpoint; also saved to evals/step_N.json."""
    import json
    from pathlib import Path

    from moelab.data.store import build_store
    from moelab.train import checkpoint, optim
    from moelab.train.loop import RunRefused, load_run_config
    from moelab.train.record import RunDir
    from moelab.train.step import init_train_state

    run = RunDir(run_dir)
    cfg = load_run_config(run.path)
    saved = checkpoint.steps(run.ckpt)
    if not saved:
        raise RunRefused(f"{run.ckpt}: no complete checkpoint to evaluate")
    step = saved[-1] if step is None else step
    if step not in saved:
        raise RunRefused(f"--checkpoint: no checkpoint at step {step} (have: {', '.join(map(str, saved))})")
    store = build_store(cfg.data, cfg.model.vocab_size, progress=progress)
    opt = optim.make_optimizer(cfg, optim.hyper(cfg))
    state, _ = checkpoint.restore(run.ckpt, step, init_train_state(cfg, opt))
    res = {"step": step, **Evaluator(cfg, store)(state["params"], state["model_state"])}
    (Path(run.path) / "evals").mkdir(exist_ok=True)
    (Path(run.path) / "evals" / f"step_{step:08d}.json").write_text(json.dumps(res, indent=1))
    return res
