"""The phased mixture: which domain each row of each batch comes from, and which window of it.

A domain's training stream (its documents packed end to end with EOT separators) is cut into
W = (T - 1) // seq_len windows of seq_len + 1 tokens; window i starts at token i * seq_len, so
neighbouring windows share one token and every token is a target once per pass.

Each row's domain is a draw from its phase's weights made by hashing (seed, step, row): it depends
on nothing else, so the domains of any step are known without reading the steps before it. The
k-th row of a domain over the whole run (counted in the order step, row) reads window
perm(k mod W) of epoch k // W, where perm is a shuffle of [0, W) made from (seed, domain, epoch): a
shuffled pass without replacement, every window exactly once per epoch, a new order each epoch.
The shuffle is a keyed Feistel network (cycle-walked into [0, W)), so no list of W indices is ever
kept. To know k, the rows each domain drew before a step are counted (vectorised, and remembered
between calls, so the next step costs one batch's work); a cold call at any step gives exactly the
batch that reaching it step by step gives.

With ``data.packing: padded`` a domain's windows are its documents instead: window i is document i
from its start (cut past seq_len + 1 tokens), the rest of the row padding outside the loss.

So batch s is a pure function of (seed, s, batch size, config and store): a resumed run reads
exactly the batches the uninterrupted one would, and two processes with one seed read the same
batches. The epochs of each domain a run will read are counted exactly from these draws, and the
epoch cap applies to them.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np

from moelab.config import Config, data_seed
from moelab.data.tokenstore import TokenStore
from moelab.errors import DataError
from moelab.schedule import phase_boundaries

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser
_ROUNDS = 8  # Feistel rounds of the window shuffle
_BLOCK = 1 << 20  # rows hashed at once when counting draws


@dataclass(frozen=True)
class Mixture:
    domains: tuple[str, ...]
    phase_steps: tuple[int, ...]  # first step of each phase
    weights: np.ndarray  # [phases, domains], rows sum to 1
    epochs: dict[str, float]  # passes over each domain's training windows the planned run reads
    # each phase's sequence length (data.phase_seq_lens); empty = every step's rows are the caller's
    # seq_len. A phase of length L holds batch_size * seq_len / L rows (the batch's tokens held)
    lengths: tuple[int, ...] = ()
    # data.packing padded: each domain's training documents, [n + 1] bounds in its stream (each
    # document with its EOT; the last bound the stream's end); empty = packed
    docs: dict = field(default_factory=dict, repr=False, compare=False)
    # counts of draws remembered between calls, per (seed, batch size); never compared or copied
    _counters: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def windows(self, store: TokenStore, domain: str, seq_len: int) -> int:
        """A pass over ``domain``'s training data, in rows: its documents (padded), or its windows of the
        first phase's length (packed; ``seq_len`` where every phase has one)."""
        if self.docs:
            return len(self.docs[domain]) - 1
        return (len(store.stream(domain, "train")) - 1) // (self.lengths[0] if self.lengths else seq_len)

    def phase_at(self, step: int) -> int:
        return int(np.searchsorted(np.asarray(self.phase_steps), step, side="right") - 1)

    def shape_at(self, step: int, batch_size: int, seq_len: int) -> tuple[int, int, int]:
        """Step ``step``'s (rows, sequence length, units per row): ``batch_size`` rows of ``seq_len``
        tokens hold the batch, cut at the phase's length; a row counts length / the first length units
        of a domain's draws (the first phase's rows count 1)."""
        if not self.lengths:
            return batch_size, seq_len, 1
        length = self.lengths[self.phase_at(step)]
        return batch_size * seq_len // length, length, length // self.lengths[0]

    def shares(self, steps: int) -> dict[str, float]:
        """Each domain's share of the rows drawn over a run of ``steps`` (phases by their length): the
        weights of the held-out loss of the distribution the run trains on (``mix``)."""
        bounds = [min(b, steps) for b in self.phase_steps] + [steps]
        length = np.array([bounds[i + 1] - bounds[i] for i in range(len(self.phase_steps))], np.float64)
        w = (length[:, None] * self.weights).sum(axis=0)
        w = w / w.sum() if w.sum() > 0 else self.weights[0]
        return {d: float(x) for d, x in zip(self.domains, w, strict=True)}


def build_mixture(cfg: Config, store: TokenStore, steps: int | None = None, seed: int | None = None) -> Mixture:
    """Weights per phase from the config, checked against the store's domains and the epoch cap
    (the exact epochs of each domain that ``steps`` steps of ``train.batch_size`` rows read with
    ``seed``, the config's data seed unless given)."""
    d = cfg.data
    steps = steps or cfg.train.steps
    seed = data_seed(cfg) if seed is None else seed
    domains = tuple(store.domains)
    sizes = np.array([len(store.stream(x, "train")) for x in domains], np.float64)
    seq_len = cfg.model.seq_len
    row = seq_len + 1
    padded = d.packing == "padded"
    for name, n in zip(domains, sizes, strict=True):
        if padded and n < 2:
            raise DataError(f"{name}: no training document to pad into a row")
        if not padded and n < row:
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
    lengths = tuple(d.phase_seq_lens) * (phases if len(d.phase_seq_lens) == 1 else 1)
    docs = {name: document_bounds(store, name, "train") for name in domains} if padded else {}
    mix = Mixture(domains, phase_steps, table, {}, lengths if len(set(lengths)) > 1 else (), docs)
    drawn = _counter(mix, seed, cfg.train.batch_size, seq_len).before(steps)  # also remembers marks for a resume
    # passes in units of the first phase's windows (a longer phase's row counts as several), or of documents
    mix.epochs.update({name: float(drawn[i] / mix.windows(store, name, seq_len)) for i, name in enumerate(domains)})
    over = {k: v for k, v in mix.epochs.items() if v > d.epoch_cap}
    if over:
        name, value = max(over.items(), key=lambda kv: kv[1])
        msg = (
            f"data.epoch_cap: the mixture needs {value:.1f} epochs of domain {name!r}, over the cap of "
            f"{d.epoch_cap:g}; lower its weight, add data, or raise data.epoch_cap"
        )
        if d.epoch_cap_action == "refuse":
            raise DataError(msg)
        warnings.warn(msg, stacklevel=2)
    return mix


def batch_at(store: TokenStore, mix: Mixture, seed: int, step: int, batch_size: int, seq_len: int):
    """Batch ``step``: tokens [rows, length + 1] int32 and each row's domain index [rows]: ``batch_size``
    rows of ``seq_len``, or the same tokens in rows of the step's phase length (``Mixture.shape_at``).
    From a store of conversations, a token that does not count in the loss is given as ``-id - 1``."""
    return batch_rows(store, mix, seed, step, batch_size, seq_len)


def batch_rows(
    store: TokenStore, mix: Mixture, seed: int, step: int, batch_size: int, seq_len: int, lo: int = 0, hi=None
):
    """Rows [lo, hi) of batch ``step`` (tokens [hi - lo, length + 1]) and every row's domain index.

    Each process of a job builds only the rows its devices hold: every row's domain and its place in
    its domain's pass are worked out for the whole batch (cheap, and the same in every process), and
    only rows lo..hi are shuffled into windows and copied out of the streams."""
    rows, length, _ = mix.shape_at(step, batch_size, seq_len)
    hi = rows if hi is None else hi
    domain_idx, k = _counter(mix, seed, batch_size, seq_len).step(step)
    out = np.empty((hi - lo, length + 1), np.int32)
    mine_d, mine_k = domain_idx[lo:hi], k[lo:hi]
    for di in np.unique(mine_d):
        name = mix.domains[di]
        stream, mask = store.stream(name, "train"), store.mask(name, "train")
        rows_of = np.flatnonzero(mine_d == di)
        if mix.docs:  # padded: one document a row
            bounds = mix.docs[name]
            which = window_of(seed, name, mine_k[rows_of], len(bounds) - 1)
            for r, w in zip(rows_of, which.tolist(), strict=True):
                out[r] = padded_row(stream, mask, int(bounds[w]), int(bounds[w + 1]), length, store.eot)
            continue
        n_windows = (len(stream) - 1) // length
        starts = window_of(seed, name, mine_k[rows_of], n_windows) * length
        for r, start in zip(rows_of, starts.tolist(), strict=True):
            out[r] = stream[start : start + length + 1]
            if mask is not None:  # conversations: a token outside the loss as -id - 1 (train.step.split_masked)
                keep = mask[start : start + length + 1].astype(bool)
                out[r] = np.where(keep, out[r], -out[r] - 1)
    return out, domain_idx


def padded_row(stream: np.ndarray, mask, start: int, end: int, length: int, eot: int) -> np.ndarray:
    """One document (``stream[start:end]``, its EOT last) as a row of ``length`` + 1 tokens from its
    start: cut past the row, the rest padding (EOT) outside the loss; a token outside the loss is given
    as ``-id - 1``, as in a packed row of conversations."""
    end = min(end, start + length + 1)
    row = np.full(length + 1, -eot - 1, np.int32)
    got = np.asarray(stream[start:end], np.int32)
    if mask is not None:
        got = np.where(np.asarray(mask[start:end]).astype(bool), got, -got - 1)
    row[: end - start] = got
    return row


def document_bounds(store: TokenStore, domain: str, split: str) -> np.ndarray:
    """[n + 1]: where each of a split's documents starts in its stream (a document ends with its EOT),
    then the stream's end. Read in blocks: a long stream is never held as one array of flags."""
    stream, eot, block = store.stream(domain, split), store.eot, 1 << 24
    ends = [np.flatnonzero(np.asarray(stream[a : a + block]) == eot) + a + 1 for a in range(0, len(stream), block)]
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    if not len(ends) or ends[-1] != len(stream):  # a stream that does not end with EOT: its last document
        ends = np.append(ends, len(stream))
    return np.concatenate([[0], ends]).astype(np.int64)


def padding_stats(mix: Mixture, length: int) -> dict[str, dict]:
    """Padded rows, per domain: its documents, the share of their tokens cut past a row of ``length`` + 1,
    and the share of a row's positions that are padding (documents weighted alike, as drawn)."""
    out = {}
    for name, bounds in mix.docs.items():
        sizes = np.diff(bounds)
        kept = np.minimum(sizes, length + 1)
        out[name] = {
            "documents": int(len(sizes)),
            "cut": float(1 - kept.sum() / max(sizes.sum(), 1)),
            "padding": float(1 - kept.mean() / (length + 1)) if len(sizes) else 0.0,
        }
    return out


def batch_targets(cfg: Config, store: TokenStore) -> tuple[bool, int | None]:
    """How a run's batches are read (``train.step.split_masked``): whether some tokens are given as
    ``-id - 1`` (outside the loss: a store of conversations, or padded rows), and the EOT that splits a
    row into documents attending each within itself (packed conversations; a padded row holds one)."""
    convo = bool(store.manifest.get("mask"))
    padded = cfg.data.packing == "padded"
    return convo or padded, store.eot if convo and not padded else None


def epochs_at(store: TokenStore, mix: Mixture, seed: int, step: int, batch_size: int, seq_len: int) -> dict[str, float]:
    """Passes over each domain's training windows read by the batches before ``step`` (windows of the
    first phase's length, or documents where padded)."""
    drawn = _counter(mix, seed, batch_size, seq_len).before(step)
    return {name: float(drawn[i] / mix.windows(store, name, seq_len)) for i, name in enumerate(mix.domains)}


def window_of(seed: int, domain: str, k, n_windows: int) -> np.ndarray:
    """The windows the draws ``k`` (counted over the run from 0) of ``domain`` read: draw k reads
    window perm(k mod W) of epoch k // W, perm the shuffle of [0, W) for (seed, domain, epoch)."""
    k = np.asarray(k, np.int64)
    epoch, i = np.divmod(k, n_windows)
    key = _fmix(epoch.astype(np.uint64) * np.uint64(_GOLDEN) + np.uint64(_domain_key(seed, domain)))
    return permute(i, n_windows, key)


def permute(i, n: int, key) -> np.ndarray:
    """A bijection of [0, n) chosen by ``key`` (one key per element, uint64), applied to ``i``: a
    Feistel network on the next even number of bits, walked along its cycles until back in range."""
    i = np.asarray(i, np.int64)
    if n <= 1:
        return np.zeros_like(i)
    half = ((n - 1).bit_length() + 1) // 2
    keys = np.broadcast_to(np.asarray(key, np.uint64), i.shape)
    rounds = [_fmix(keys + np.uint64((r + 1) * _C1 & _MASK)) for r in range(_ROUNDS)]
    x = _feistel(i.astype(np.uint64), rounds, half)
    todo = np.flatnonzero(x >= n)
    while todo.size:  # cycle walking: at most 4x the domain, so few steps on average
        x[todo] = _feistel(x[todo], [rk[todo] for rk in rounds], half)
        todo = todo[x[todo] >= n]
    return x.astype(np.int64)


def draws(mix: Mixture, seed: int, batch_size: int, lo: int, hi: int, seq_len: int = 0) -> np.ndarray:
    """Each domain's number of rows in the batches of steps [lo, hi) (with phase lengths, in units of
    the first phase's rows: ``Mixture.shape_at``)."""
    return _count(mix, seed, batch_size, seq_len, lo, hi)


# ---------------------------------------------------------------------------------------- internals


def _fmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64 that spreads every bit over all of them), in
    place: ``z`` is a fresh uint64 array of the caller's."""
    t = np.empty_like(z)
    np.right_shift(z, np.uint64(30), out=t)
    z ^= t
    z *= np.uint64(_C1)
    np.right_shift(z, np.uint64(27), out=t)
    z ^= t
    z *= np.uint64(_C2)
    np.right_shift(z, np.uint64(31), out=t)
    z ^= t
    return z


def _mix(x: int) -> int:
    """``_fmix`` of one Python integer."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * _C1) & _MASK
    x = ((x ^ (x >> 27)) * _C2) & _MASK
    return x ^ (x >> 31)


def _seed_key(seed: int, tag: int) -> int:
    return _mix(_mix((int(seed) + _GOLDEN) & _MASK) ^ tag)


def _domain_key(seed: int, domain: str) -> int:
    name = int.from_bytes(hashlib.blake2b(domain.encode(), digest_size=8).digest(), "little")
    return _mix(_seed_key(seed, 2) ^ name)


def _feistel(x: np.ndarray, rounds: list[np.ndarray], half: int) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for rk in rounds:
        left, right = right, left ^ (_fmix(right + rk) & mask)
    return (left << np.uint64(half)) | right


def _hash_rows(seed: int, steps: np.ndarray, batch_size: int) -> np.ndarray:
    """A uniform uint64 for every (step, row): splitmix64 at the counter step * 2^32 + row."""
    rows = np.arange(batch_size, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(_seed_key(seed, 1))
    z = steps.astype(np.uint64)[:, None] * np.uint64((_GOLDEN << 32) & _MASK) + rows[None, :]
    return _fmix(z)


def _cuts(weights: np.ndarray) -> np.ndarray:
    """The hash values at which one domain's share ends and the next one's begins: a row whose hash
    is at least c_j (and below c_j+1) is of domain j + 1. Cuts that would sit at the very top (only
    zero weights after them) are left out, so those domains are never drawn."""
    cum = np.cumsum(weights)
    cuts = []
    for c in cum[:-1]:
        at = int(round(float(c / cum[-1]) * 2**53)) << 11
        if c >= cum[-1] or at > _MASK:
            break
        cuts.append(at)
    return np.array(cuts, np.uint64)


def _domains_of(z: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    out = np.zeros(z.shape, np.int64)
    for c in cuts:
        out += z >= c
    return out


def _segments(mix: Mixture, lo: int, hi: int):
    """[lo, hi) cut at the phase boundaries: (start, end, phase)."""
    edges = sorted({lo, hi, *(b for b in mix.phase_steps if lo < b < hi)})
    return [(a, b, mix.phase_at(a)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _per_block(batch_size: int) -> int:
    """Steps hashed at once when counting (about ``_BLOCK`` rows); counts are remembered at their multiples."""
    return max(1, _BLOCK // max(batch_size, 1))


def _count(mix: Mixture, seed: int, batch_size: int, seq_len: int, lo: int, hi: int, marks=None, base=None):
    """Each domain's draws (units) in steps [lo, hi), hashed a block of steps at a time. With ``marks``,
    the running total (from ``base``, the count before ``lo``) is kept at every block boundary."""
    per_block = _per_block(batch_size)
    total = np.zeros(len(mix.domains), np.int64)
    for a, b, phase in _segments(mix, lo, hi):
        cuts = _cuts(mix.weights[phase])
        rows, _, units = mix.shape_at(a, batch_size, seq_len)
        while a < b:
            end = min(b, (a // per_block + 1) * per_block)  # blocks aligned to multiples of per_block
            z = _hash_rows(seed, np.arange(a, end, dtype=np.uint64), rows)
            below = [np.count_nonzero(z < c) for c in cuts]
            total[: len(cuts) + 1] += np.diff([0, *below, z.size]) * units
            a = end
            if marks is not None and end % per_block == 0:
                marks[end] = base + total
    return total


class _Counter:
    """Draws each domain made before a step, for one (mixture, seed, batch size, length): the last step
    asked for (and the next), and marks every block of steps, so sequential steps cost one batch each
    and a jump costs the steps from the nearest known point. A draw is a row of the first phase's
    length; a row of a longer phase counts as length / first length draws."""

    def __init__(self, mix: Mixture, seed: int, batch_size: int, seq_len: int):
        self.mix, self.seed, self.batch, self.seq_len = mix, seed, batch_size, seq_len
        self.known = {0: np.zeros(len(mix.domains), np.int64)}  # step -> draws before it
        self.last = None  # (step, its domains, k)
        self.lock = threading.Lock()

    def before(self, step: int) -> np.ndarray:
        with self.lock:
            return self._before(step).copy()

    def _before(self, step: int) -> np.ndarray:
        if step in self.known:
            return self.known[step]
        near = min(self.known, key=lambda s: (abs(s - step), s))
        base = self.known[near]
        args = (self.mix, self.seed, self.batch, self.seq_len)
        if near < step:  # on from there, remembering the counts at each block's end on the way
            return base + _count(*args, near, step, self.known, base)
        return base - _count(*args, step, near)

    def step(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Step ``step``'s row domains and each row's draw number k in its domain (counted in the
        step's own rows: the draws before it over the row's units, rounded up, then one per row)."""
        with self.lock:
            if self.last is not None and self.last[0] == step:
                return self.last[1].copy(), self.last[2].copy()
            before = self._before(step)
            rows, _, units = self.mix.shape_at(step, self.batch, self.seq_len)
            z = _hash_rows(self.seed, np.array([step], np.uint64), rows)[0]
            domains = _domains_of(z, _cuts(self.mix.weights[self.mix.phase_at(step)]))
            k = np.empty(rows, np.int64)
            after = before.copy()
            for d in np.unique(domains):
                mine = np.flatnonzero(domains == d)
                k[mine] = -(-before[d] // units) + np.arange(len(mine))
                after[d] += len(mine) * units
            if self.last is not None:  # keep the marks; forget the previous step's own points
                for s in (self.last[0], self.last[0] + 1):
                    if s % _per_block(self.batch) and s in self.known:
                        del self.known[s]
            self.known[step], self.known[step + 1] = before, after
            self.last = (step, domains, k)
            return domains.copy(), k.copy()


def _counter(mix: Mixture, seed: int, batch_size: int, seq_len: int = 0) -> _Counter:
    key = (int(seed), int(batch_size), int(seq_len) if mix.lengths else 0)
    got = mix._counters.get(key)
    if got is None:
        got = mix._counters.setdefault(key, _Counter(mix, seed, batch_size, seq_len))
    return got
