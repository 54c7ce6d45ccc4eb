"""Held-out evaluation: loss and bits per byte per domain and their macro average, as trained and dropless.

Each domain is evaluated on the same windows every time: up to ``train.eval_tokens`` target tokens
in non-overlapping windows spread evenly over its whole held-out stream, so that a small budget
still samples every part of the held-out documents (the first few documents alone can sit far from
the domain's mean: on a JavaScript corpus 0.9 nats below it). ``offset`` picks a disjoint set of
windows beside the usual one, to measure the evaluation's own noise (`eval_noise`).
"""

from __future__ import annotations

import math

import numpy as np

from moelab.config import Config, phase_config, phase_seq_lens
from moelab.data.mixture import batch_targets, build_mixture, document_bounds, padded_row
from moelab.data.store import TokenStore, build_store
from moelab.errors import RunRefused
from moelab.parallel.mesh import put_batch
from moelab.runs import RunDir, load_run_config
from moelab.train import checkpoint, optim
from moelab.train.step import init_train_state, make_eval_step


def eval_windows(
    store: TokenStore, domain: str, seq_len: int, max_tokens: int, offset: int = 0, padded: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Rows [n, seq_len + 1] and a mask [n, seq_len] of the targets that count.

    The held-out stream is cut into non-overlapping windows; n = max_tokens // seq_len of them are
    taken at an even stride from the first, and ``offset`` (< stride) shifts every one of them.
    ``padded`` (data.packing padded, as the run trains): the windows are the held-out documents, one a
    row from its start, cut and padded as in training (moelab.data.mixture.padded_row)."""
    if padded:
        return _padded_windows(store, domain, seq_len, max_tokens, offset)
    stream = np.asarray(store.stream(domain, "heldout"), np.int32)
    n_all = (len(stream) - 1) // seq_len
    n = min(max(max_tokens // seq_len, 1), n_all)
    if n == 0:  # a held-out stream shorter than one window: one padded row
        if offset:
            raise ValueError(f"{domain}: one held-out window only; no disjoint set at offset {offset}")
        row = np.full(seq_len + 1, store.eot, np.int32)
        row[: len(stream)] = stream
        mask = np.zeros(seq_len, np.float32)
        mask[: len(stream) - 1] = 1.0
        if (counts := store.mask(domain, "heldout")) is not None:
            mask[: len(stream) - 1] *= counts[1:]
        return row[None], mask[None]
    stride = n_all // n
    if not 0 <= offset < stride:
        raise ValueError(f"{domain}: offset {offset} outside the {stride} disjoint window sets")
    starts = (np.arange(n) * stride + offset) * seq_len
    rows = np.stack([stream[i : i + seq_len + 1] for i in starts])
    mask = store.mask(domain, "heldout")
    if mask is not None:  # conversations: the assistant's tokens only
        return rows, np.stack([mask[i + 1 : i + seq_len + 1] for i in starts]).astype(np.float32)
    return rows, np.ones((n, seq_len), np.float32)


def _padded_windows(store: TokenStore, domain: str, seq_len: int, max_tokens: int, offset: int):
    stream, counts = store.stream(domain, "heldout"), store.mask(domain, "heldout")
    bounds = document_bounds(store, domain, "heldout")
    n_all = len(bounds) - 1
    n = min(max(max_tokens // seq_len, 1), n_all)
    stride = n_all // n
    if not 0 <= offset < stride:
        raise ValueError(f"{domain}: offset {offset} outside the {stride} disjoint document sets")
    which = np.arange(n) * stride + offset
    rows = np.stack([padded_row(stream, counts, int(bounds[i]), int(bounds[i + 1]), seq_len, store.eot) for i in which])
    return np.where(rows < 0, -rows - 1, rows), (rows[:, 1:] >= 0).astype(np.float32)


def disjoint_sets(store: TokenStore, seq_len: int, max_tokens: int, padded: bool = False) -> dict[str, int]:
    """How many disjoint window sets each domain's held-out stream holds (1: the evaluation reads
    all of it, or all it can); ``padded``: sets of documents."""
    sets = {}
    for domain in store.domains:
        n_all = (len(store.stream(domain, "heldout")) - 1) // seq_len
        if padded:
            n_all = len(document_bounds(store, domain, "heldout")) - 1
        n = min(max(max_tokens // seq_len, 1), n_all)
        sets[domain] = max(1, n_all // n) if n else 1
    return sets


def _no_cap(cfg: Config) -> Config:
    """The config with its epoch cap off: the evaluation only reads the mixture's weights."""
    import dataclasses

    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, epoch_cap=float("inf")))


class Evaluator:
    """Held-out losses of a model. With ``mesh`` the windows are split over its devices like a
    training batch and the model runs as it trains there (the expert-parallel transports, FSDP
    gathers), never gathering every expert onto every device."""

    def __init__(self, cfg: Config, store: TokenStore, offset: int | dict = 0, dropless_only: bool = False, mesh=None):

        self.cfg, self.mesh = cfg, mesh
        self.fn = make_eval_step(cfg, mesh, batch_targets(cfg, store)[1])
        padded = cfg.data.packing == "padded"
        m = cfg.model
        # as trained (the training dispatch, with its drops) and dropless
        self.dispatches = {"_dropless": "dropless"} if dropless_only else {"": m.dispatch, "_dropless": "dropless"}
        b = cfg.train.batch_size
        # `mix`: the domains weighted by their share of the training rows, the loss of what the run trains on
        self.shares = build_mixture(_no_cap(cfg), store).shares(cfg.train.steps) if store.domains else {}
        self.data = {}
        # training domains with a held-out part (data.held_out_fraction 0 holds out nothing), then the
        # validation sets (data.validation): evaluated, never trained on, outside macro and mix
        self.train_domains = [d for d in store.domains if len(store.stream(d, "heldout")) >= 2]
        for domain in self.train_domains + [d for d in store.validation if len(store.stream(d, "heldout")) >= 2]:
            at = offset.get(domain, 0) if isinstance(offset, dict) else offset
            rows, mask = eval_windows(store, domain, m.seq_len, cfg.train.eval_tokens, at, padded)
            n_bytes = float(np.sum(store.byte_lengths[np.clip(rows[:, 1:], 0, len(store.byte_lengths) - 1)] * mask))
            pad = (-len(rows)) % b
            if pad:
                rows = np.concatenate([rows, np.repeat(rows[-1:], pad, 0)])
                mask = np.concatenate([mask, np.zeros((pad, m.seq_len), np.float32)])
            self.data[domain] = (rows.reshape(-1, b, m.seq_len + 1), mask.reshape(-1, b, m.seq_len), n_bytes)

    def __call__(self, params, model_state) -> dict:
        out: dict = {}
        for suffix, dispatch in self.dispatches.items():
            if suffix and dispatch == self.dispatches.get(""):  # trained dropless: the same numbers
                out[f"loss{suffix}"], out[f"bpb{suffix}"] = out["loss"], out["bpb"]
                continue
            # every batch of every domain dispatched first, then read: the device is never idle while
            # Python reads a sum (the sums add up in the same order as before)
            sums = {}
            for domain, (rows, mask, _) in self.data.items():
                sums[domain] = []
                for r, mk in zip(rows, mask, strict=True):
                    inputs, targets = r[:, :-1], r[:, 1:]
                    if self.mesh is not None:
                        inputs, targets, mk = (
                            put_batch(np.ascontiguousarray(a), self.mesh) for a in (inputs, targets, mk)
                        )
                    sums[domain].append(self.fn(params, model_state, inputs, targets, mk, dispatch=dispatch))
            losses, bpbs = {}, {}
            for domain, (_, _, n_bytes) in self.data.items():
                total, count = 0.0, 0.0
                for s, c in sums[domain]:
                    total += float(s)
                    count += float(c)
                losses[domain] = total / max(count, 1.0)
                bpbs[domain] = total / math.log(2) / max(n_bytes, 1.0)
            trained = self.train_domains
            if trained:
                share = sum(self.shares[d] for d in trained) or 1.0
                losses["macro"] = float(np.mean([losses[d] for d in trained]))
                bpbs["macro"] = float(np.mean([bpbs[d] for d in trained]))
                losses["mix"] = float(sum(self.shares[d] * losses[d] for d in trained) / share)
                bpbs["mix"] = float(sum(self.shares[d] * bpbs[d] for d in trained) / share)
            out[f"loss{suffix}"] = losses
            out[f"bpb{suffix}"] = bpbs
        return out


def restored(run_dir, step: int | None = None, progress: bool = True, final: bool = True):
    """(run, config, token store, state, step) of a run's newest (or a given) checkpoint. With
    ``final``, the config is the last phase's (its context and RoPE; moelab.config.phase_config): the
    model as the run ends, evaluated as it trains there."""

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
    if final:
        cfg = phase_config(cfg, len(phase_seq_lens(cfg)) - 1)
    return run, cfg, store, state, step


def evaluate_run(run_dir, step: int | None = None, progress: bool = True, data: list[str] | None = None) -> dict:
    """`moelab eval`: evaluate a run's newest (or a given) checkpoint; also saved to evals/step_N.json.
    ``data``: sources (any of data.sources' forms) evaluated whole instead of the run's held-out
    split, tokenized with the run's own tokenizer; saved to evals/step_N-data-KEY.json."""
    import dataclasses
    import json

    run, cfg, store, state, step = restored(run_dir, step, progress)
    name = f"step_{step:08d}.json"
    if data:
        dcfg = dataclasses.replace(cfg.data, sources=(), validation=tuple(data), held_out_fraction=0.0,
                                   max_bytes_per_domain=0, include=(), exclude=())  # fmt: skip
        store = build_store(dcfg, cfg.model.vocab_size, progress=progress, tokenizer_dir=store.path)
        name = f"step_{step:08d}-data-{store.manifest['key']}.json"
    res = {"step": step, **Evaluator(cfg, store)(state["params"], state["model_state"])}
    if data:
        res["data"] = list(data)
    (run.path / "evals").mkdir(exist_ok=True)
    (run.path / "evals" / name).write_text(json.dumps(res, indent=1))
    return res


def eval_noise(run_dir, step: int | None = None, sets: int = 8, progress: bool = True, against=None) -> dict:
    """The evaluation's own noise: one checkpoint evaluated on up to ``sets`` disjoint sets of
    held-out windows (the usual set and its shifted neighbours), dropless; the spread of the macro
    loss across sets, relative to its mean, is the noise of one evaluation of ``train.eval_tokens``.
    A domain whose held-out stream holds one set only (the evaluation reads all of it) is read the
    same in every set: it adds nothing that another choice of windows would change.

    Every run is evaluated on the same windows, so much of that is shared: with ``against`` (another
    run on the same data, its newest checkpoint) the spread of the ratio of the two losses across the
    sets is the part that does not cancel between runs (``paired_relative_sd``)."""

    run, cfg, store, state, step = restored(run_dir, step, progress)
    per = disjoint_sets(store, cfg.model.seq_len, cfg.train.eval_tokens, cfg.data.packing == "padded")
    n = min(sets, max(per.values()))
    if n < 2:
        raise RunRefused(
            f"{run.path}: every held-out stream holds one set of eval windows only; lower train.eval_tokens"
        )

    def losses(cfg, store, state) -> list[dict]:
        return [Evaluator(cfg, store, offset={d: k % per[d] for d in per}, dropless_only=True)(
                    state["params"], state["model_state"])["loss_dropless"] for k in range(n)]  # fmt: skip

    sets_ = losses(cfg, store, state)
    macro = np.array([x["macro"] for x in sets_])
    out = {
        "run": str(run.path),
        "step": step,
        "sets": n,
        "eval_tokens_per_domain": cfg.train.eval_tokens,
        "macro": macro.tolist(),
        "relative_sd": float(macro.std(ddof=1) / macro.mean()),
        "per_domain_relative_sd": {
            d: float(np.std([x[d] for x in sets_], ddof=1) / np.mean([x[d] for x in sets_]))
            for d in store.domains
            if per[d] > 1
        },
        "read_whole": [d for d in store.domains if per[d] == 1],
    }
    if against is not None:
        other, ocfg, ostore, ostate, ostep = restored(against, None, progress)
        if ostore.manifest["key"] != store.manifest["key"] or ocfg.train.eval_tokens != cfg.train.eval_tokens:
            raise RunRefused(f"{other.path}: not evaluated on the same held-out windows as {run.path}")
        ratio = macro / np.array([x["macro"] for x in losses(ocfg, ostore, ostate)])
        out.update(
            paired_with=str(other.path), paired_step=ostep, paired_relative_sd=float(ratio.std(ddof=1) / ratio.mean())
        )
    return out
