"""The phased mixture: which domain each row of each batch comes from, and where in it.

Batch s is a pure function of (seed, s, config and store): a resumed run reads exactly the
batches the uninterrupted one would, and two processes with one seed read the same batches.
Rows are windows of seq_len + 1 tokens of one domain's training stream, in which documents are
packed end to end with EOT separators.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from moelab.config import Config
from moelab.data.sources import DataError
from moelab.data.store import TokenStore
from moelab.train.schedule import phase_boundaries


@dataclass(frozen=True)
class Mixture:
    domains: tuple[str, ...]
    phase_steps: tuple[int, ...]  # first step of each phase
    weights: np.ndarray  # [phases, domains], rows sum to 1
    epochs: dict[str, float]  # expected passes over each domain's training tokens

    def phase_at(self, step: int) -> int:
        return int(np.searchsorted(np.asarray(self.phase_steps), step, side="right") - 1)

    def shares(self, steps: int) -> dict[str, float]:
        """Each domain's share of the rows drawn over a run of ``steps`` (phases by their length): the
        weights of the held-out loss of the distribution the run trains on (``mix``)."""
        bounds = [min(b, steps) for b in self.phase_steps] + [steps]
        length = np.array([bounds[i + 1] - bounds[i] for i in range(len(self.phase_steps))], np.float64)
        w = (length[:, None] * self.weights).sum(axis=0)
        w = w / w.sum() if w.sum() > 0 else self.weights[0]
        return {d: float(x) for d, x in zip(self.domains, w, strict=True)}


def build_mixture(cfg: Config, store: TokenStore, steps: int | None = None) -> Mixture:
    """Weights per phase from the config, checked against the store's domains and the epoch cap."""
    d = cfg.data
    steps = steps or cfg.train.steps
    domains = tuple(store.domains)
    sizes = np.array([len(store.stream(x, "train")) for x in domains], np.float64)
    row = cfg.model.seq_len + 1
    for name, n in zip(domains, sizes, strict=True):
        if n < row:
            raise DataError(f"{name}: only {int(n)} training tokens, fewer than model.seq_len + 1 = {row}")
    phases = len(d.phase_starts)
    table = np.zeros((phases, len(domains)))
    given = list(d.mixture) or [None]
    for p in range(phases):
        weights = given[p] if len(given) > 1 else given[0]
        if weights is None:
            table[p] = sizes
            continue
        for name, w in weights.items():
            if name not in domains:
                raise DataError(
                    f"data.mixture[{min(p, len(given) - 1)}].{name}: unknown domain (known: {', '.join(domains)})"
                )
            table[p, domains.index(name)] = w
    table /= table.sum(axis=1, keepdims=True)
    if steps == cfg.train.steps:  # moved by any re-plan of the horizon
        phase_steps = phase_boundaries(d.phase_starts, cfg.train)
    else:
        phase_steps = tuple(int(round(f * steps)) for f in d.phase_starts)
    bounds = list(phase_steps) + [steps]
    rows = np.array([bounds[i + 1] - bounds[i] for i in range(phases)]) * cfg.train.batch_size
    drawn = (rows[:, None] * table).sum(axis=0) * row
    epochs = {name: float(drawn[i] / sizes[i]) for i, name in enumerate(domains)}
    over = {k: v for k, v in epochs.items() if v > d.epoch_cap}
    if over:
        name, value = max(over.items(), key=lambda kv: kv[1])
        msg = (
            f"data.epoch_cap: the mixture needs {value:.1f} epochs of domain {name!r}, over the cap of "
            f"{d.epoch_cap:g}; lower its weight, add data, or raise data.epoch_cap"
        )
        if d.epoch_cap_action == "refuse":
            raise DataError(msg)
        warnings.warn(msg, stacklevel=2)
    return Mixture(domains, phase_steps, table, epochs)


def batch_at(store: TokenStore, mix: Mixture, seed: int, step: int, batch_size: int, seq_len: int):
    """Batch ``step``: tokens [batch, seq_len + 1] int32 and each row's domain index [batch]."""
    return batch_rows(store, mix, seed, step, batch_size, seq_len)


def batch_rows(
    store: TokenStore, mix: Mixture, seed: int, step: int, batch_size: int, seq_len: int, lo: int = 0, hi=None
):
    """Rows [lo, hi) of batch ``step`` (tokens [hi - lo, seq_len + 1]) and every row's domain index.

    Each process of a job builds only the rows its devices hold: every row's domain and window
    start are drawn (cheap, and in the same order, so the rows are those of the whole batch), and
    only rows lo..hi are copied out of the streams."""
    hi = batch_size if hi is None else hi
    rng = np.random.default_rng(np.random.SeedSequence([seed, step]))
    probs = mix.weights[mix.phase_at(step)]
    domain_idx = rng.choice(len(mix.domains), size=batch_size, p=probs)
    out = np.empty((hi - lo, seq_len + 1), np.int32)
    for r, di in enumerate(domain_idx):
        stream = store.stream(mix.domains[di], "train")
        start = int(rng.integers(0, len(stream) - seq_len))  # windows may start anywhere, EOTs inside
        if lo <= r < hi:
            out[r - lo] = stream[start : start + seq_len + 1]
    return out, domain_idx
