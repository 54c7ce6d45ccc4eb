"""The loader's semantics: each domain read as a seeded shuffled pass without replacement, epochs
counted exactly (and capped), a resume that reproduces the uninterrupted run, each process's rows."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.config import load_config, replace
from moelab.data import mixture as M
from moelab.data.sources import DataError


class FakeStore:
    """A store over small arrays: token t of a domain's training stream is ``offset + t``, so a
    row's first token names its domain and window."""

    def __init__(self, sizes: dict[str, int]):
        self._streams = {d: (np.arange(n) + 1_000_000 * i).astype(np.int32) for i, (d, n) in enumerate(sizes.items())}

    @property
    def domains(self) -> list[str]:
        return list(self._streams)

    def stream(self, domain: str, split: str) -> np.ndarray:
        assert split == "train"
        return self._streams[domain]

    def mask(self, domain: str, split: str) -> None:
        return None  # no conversations: every token counts


def window_index(row: np.ndarray, seq_len: int) -> int:
    first = int(row[0]) % 1_000_000
    assert first % seq_len == 0
    return first // seq_len


def mixture(domains, phase_steps, weights) -> M.Mixture:
    return M.Mixture(tuple(domains), tuple(phase_steps), np.asarray(weights, np.float64), {})


def test_every_window_exactly_once_per_epoch_and_a_new_order_each_epoch():
    seq_len, n_windows, batch = 4, 37, 5  # 5 does not divide 37: epochs end inside a batch
    store = FakeStore({"a": n_windows * seq_len + 3})  # a tail shorter than a window is never read
    mix = mixture(["a"], [0], [[1.0]])
    stream = store.stream("a", "train")
    seen = []
    for s in range(16):  # 80 rows: two whole epochs and the start of a third
        tokens, domains = M.batch_at(store, mix, 11, s, batch, seq_len)
        assert tokens.dtype == np.int32 and tokens.shape == (batch, seq_len + 1) and not domains.any()
        for row in tokens:
            w = window_index(row, seq_len)
            np.testing.assert_array_equal(row, stream[w * seq_len : w * seq_len + seq_len + 1])
            seen.append(w)
    first, second, third = seen[:n_windows], seen[n_windows : 2 * n_windows], seen[2 * n_windows :]
    assert sorted(first) == sorted(second) == list(range(n_windows))
    assert first != second and first != list(range(n_windows))  # shuffled, and reshuffled
    assert len(set(third)) == len(third)
    # another seed, another order
    other = [window_index(r, seq_len) for s in range(8) for r in M.batch_at(store, mix, 12, s, batch, seq_len)[0]]
    assert other[:n_windows] != first


@pytest.mark.parametrize("block", [None, 24])
def test_a_cold_batch_mid_epoch_equals_the_one_reached_step_by_step(monkeypatch, block):
    if block:  # remembered counts every 3 steps (of 8 rows): the cold calls start from one of them
        monkeypatch.setattr(M, "_BLOCK", block)
    seq_len, batch, seed = 8, 8, 5
    store = FakeStore({"a": 23 * seq_len + 1, "b": 9 * seq_len + 5})
    fields = (["a", "b"], [0, 20], [[0.8, 0.2], [0.3, 0.7]])
    walked = mixture(*fields)
    sequential = [M.batch_at(store, walked, seed, s, batch, seq_len) for s in range(40)]
    for s in (0, 13, 20, 27, 39):
        epochs = M.epochs_at(store, mixture(*fields), seed, s, batch, seq_len)
        if s:
            assert all(e != int(e) for e in epochs.values()), epochs  # a point inside both passes
        fresh = mixture(*fields)
        for t in range(s, 40):  # a resumed run from step s on
            tokens, domains = M.batch_at(store, fresh, seed, t, batch, seq_len)
            np.testing.assert_array_equal(tokens, sequential[t][0])
            np.testing.assert_array_equal(domains, sequential[t][1])
    # back and forth on one mixture (a data_stuck fault repeats steps) changes nothing either, nor do
    # jumps from the counts remembered by a long cold count (as build_mixture leaves them)
    jumper = mixture(*fields)
    for mix in (walked, jumper):
        for s in (39, 31, 12, 12, 14, 30, 2, 25, 39):
            np.testing.assert_array_equal(M.batch_at(store, mix, seed, s, batch, seq_len)[0], sequential[s][0])


def test_each_process_builds_only_its_rows_of_the_same_batch():
    seq_len, batch = 8, 12
    store = FakeStore({"a": 50 * seq_len + 1, "b": 7 * seq_len + 1})
    mix = mixture(["a", "b"], [0], [[0.5, 0.5]])
    for s in (0, 9, 10):
        whole, domains = M.batch_at(store, mix, 3, s, batch, seq_len)
        for lo, hi in ((0, 6), (6, 12), (3, 7), (11, 12), (0, 12)):
            fresh = mixture(["a", "b"], [0], [[0.5, 0.5]])  # a process that has not seen the steps before
            part, d = M.batch_rows(store, fresh, 3, s, batch, seq_len, lo, hi)
            assert part.shape == (hi - lo, seq_len + 1)
            np.testing.assert_array_equal(part, whole[lo:hi])
            np.testing.assert_array_equal(d, domains)


def test_row_domains_follow_each_phases_weights():
    seq_len, batch = 4, 32
    store = FakeStore({"a": 400 * seq_len + 1, "b": 400 * seq_len + 1, "c": 400 * seq_len + 1})
    weights = [[0.6, 0.0, 0.4], [0.1, 0.9, 0.0]]
    mix = mixture(["a", "b", "c"], [0, 150], weights)
    for phase, (lo, hi) in enumerate(((0, 150), (150, 300))):
        rows = np.concatenate([M.batch_at(store, mix, 9, s, batch, seq_len)[1] for s in range(lo, hi)])
        np.testing.assert_array_equal(np.bincount(rows, minlength=3), M.draws(mix, 9, batch, lo, hi))
        for d, want in enumerate(weights[phase]):
            share = float(np.mean(rows == d))
            if want == 0:
                assert share == 0
                continue
            sigma = np.sqrt(want * (1 - want) / len(rows))
            assert abs(share - want) < 4.5 * sigma, (phase, d, share, want)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 16, 17, 100, 1000, 4097])
def test_the_shuffle_is_a_bijection(n):
    for key in (0, 1, 2**63 + 12345):
        out = M.permute(np.arange(n), n, np.uint64(key))
        assert sorted(out.tolist()) == list(range(n))
    # the draws of a domain: each epoch a permutation of its windows, each a different one when n > 2
    k = np.arange(3 * n)
    w = M.window_of(4, "code", k, n).reshape(3, n)
    assert all(sorted(e.tolist()) == list(range(n)) for e in w)
    if n > 8:
        assert len({tuple(e) for e in w}) == 3


def cfg_for(*more):
    return load_config(
        "tiny", ["data.mixture=[{a: 0.7, b: 0.3}, {a: 0.2, b: 0.8}]", "train.steps=60", "train.batch_size=8", *more]
    )


def test_epochs_are_the_draws_counted_and_the_cap_applies_to_them():
    cfg = cfg_for("data.epoch_cap=100")
    seq_len, batch, steps = cfg.model.seq_len, cfg.train.batch_size, cfg.train.steps
    store = FakeStore({"a": 100 * seq_len + 1, "b": 15 * seq_len + 70})  # W = 100 and 15
    mix = M.build_mixture(cfg, store)
    assert mix.phase_steps == (0, 48)
    counted = np.zeros(2, np.int64)
    for s in range(steps):
        counted += np.bincount(M.batch_at(store, mix, cfg.train.seed, s, batch, seq_len)[1], minlength=2)
    assert counted.sum() == steps * batch
    assert mix.epochs == {"a": counted[0] / 100, "b": counted[1] / 15}
    assert M.epochs_at(store, mix, cfg.train.seed, steps, batch, seq_len) == mix.epochs
    # another seed draws other rows: its own exact count
    other = M.build_mixture(cfg, store, seed=cfg.train.seed + 1)
    assert other.epochs["b"] == M.draws(other, cfg.train.seed + 1, batch, 0, steps)[1] / 15
    # a re-planned horizon counts its own steps
    half = M.build_mixture(cfg, store, steps=30)
    assert half.epochs["a"] == M.draws(half, cfg.train.seed, batch, 0, 30)[0] / 100
    # the cap: just below the exact epochs of b it refuses (or warns), at them it passes
    need = mix.epochs["b"]
    with pytest.raises(DataError, match=rf"data.epoch_cap: the mixture needs {need:.1f} epochs of domain 'b'"):
        M.build_mixture(replace(cfg, data={"epoch_cap": need - 1e-9}), store)
    with pytest.warns(UserWarning, match="data.epoch_cap"):
        M.build_mixture(replace(cfg, data={"epoch_cap": need - 1e-9, "epoch_cap_action": "warn"}), store)
    assert M.build_mixture(replace(cfg, data={"epoch_cap": need}), store).epochs == mix.epochs


def test_counting_a_long_run_is_vectorised():
    mix = mixture(["a", "b"], [0, 300_000], [[0.3, 0.7], [0.8, 0.2]])
    counts = M.draws(mix, 1, 256, 0, 400_000)  # about half a second
    assert counts.sum() == 400_000 * 256
    assert abs(counts[0] / counts.sum() - (0.3 * 3 + 0.8) / 4) < 1e-3
