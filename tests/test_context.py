"""The long-context phase: sequence lengths per phase with the batch's tokens held, RoPE scaling
against its formulas, and an exact resume across the change."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO
from moelab.config import ConfigError, final_model, load_config, phase_config, rope_scaling_of
from moelab.model.layers import rope, rope_frequencies
from moelab.runs import RunDir, read_jsonl
from moelab.train.loop import train


def _angles_by_hand(kind: str, i: int, half: int, theta: float, s: float, base: int) -> tuple[float, float]:
    """Frequency i and the cos/sin factor, written out from the papers (not from rope_frequencies)."""
    f = theta ** (-i / half)
    if kind == "pi":  # Chen et al.: positions divided by s
        return f / s, 1.0
    if kind == "ntk":  # the base raised so the lowest frequency stretches by s
        d = 2 * half
        return (theta * s ** (d / (d - 2))) ** (-i / half), 1.0
    wavelength = 2 * math.pi / f  # YaRN: interpolate dims whose wavelength is long against the context
    rotations = base / wavelength
    if rotations < 1:
        g = 0.0
    elif rotations > 32:
        g = 1.0
    else:
        g = (rotations - 1) / 31
    return f * ((1 - g) / s + g), 0.1 * math.log(s) + 1


@pytest.mark.parametrize("kind", ["pi", "ntk", "yarn"])
def test_rope_scaling_equals_its_formula_at_chosen_positions(kind):
    half, theta, s, base = 8, 10000.0, 4.0, 64
    x = np.random.default_rng(0).normal(size=(1, 5, 1, 2 * half)).astype(np.float32)
    positions = np.array([0, 1, 63, 64, 255])
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(positions), 1.0, theta, (kind, s, base)))
    for j, p in enumerate(positions):
        for i in range(half):
            f, mscale = _angles_by_hand(kind, i, half, theta, s, base)
            c, sn = math.cos(p * f) * mscale, math.sin(p * f) * mscale
            a, b = x[0, j, 0, i], x[0, j, 0, i + half]
            np.testing.assert_allclose(
                got[0, j, 0, [i, i + half]], [a * c - b * sn, b * c + a * sn], rtol=2e-4, atol=2e-4
            )
    # no scaling at a factor of 1, and none for the model before a longer phase
    np.testing.assert_array_equal(rope_frequencies(half, theta, (kind, 1.0, base))[0], rope_frequencies(half, theta)[0])


def test_pi_is_plain_rope_at_interpolated_positions():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, 2, 16)).astype(np.float32))
    pos = jnp.arange(6) * 37
    np.testing.assert_allclose(rope(x, pos, 1.0, 500.0, ("pi", 8.0, 32)), rope(x, pos / 8.0, 1.0, 500.0), atol=1e-5)


def test_a_phase_holds_the_batch_tokens_in_fewer_longer_sequences(corpus):
    from moelab.data.mixture import batch_at, build_mixture
    from moelab.data.store import build_store

    cfg = load_config("tiny", MICRO + [f"data.sources=[{corpus['code']}]", "train.steps=12",
                                       "data.phase_starts=[0.0,0.5]", "data.phase_seq_lens=[8,32]"])  # fmt: skip
    store = build_store(cfg.data, cfg.model.vocab_size, progress=False)
    mix = build_mixture(cfg, store)
    b, s = cfg.train.batch_size, cfg.model.seq_len
    shapes = [batch_at(store, mix, 0, step, b, s)[0].shape for step in range(12)]
    assert shapes == [(16, 9)] * 6 + [(4, 33)] * 6  # 4 x 32 = 16 x 8 tokens a step, the targets' extra token apart
    for step in (0, 6):  # every row is a window of the training stream
        rows = batch_at(store, mix, 0, step, b, s)[0]
        stream = np.asarray(store.stream(store.domains[0], "train"))
        for r in rows:
            starts = np.flatnonzero(stream[: len(stream) - len(r) + 1] == r[0])
            assert any(np.array_equal(stream[a : a + len(r)], r) for a in starts)
    # a step's batch read cold (as a resume reads it, the draws before it counted across both phases)
    # is the batch that reaching it step by step gives
    for step in (7, 11, 3):
        fresh = build_mixture(cfg, store)
        np.testing.assert_array_equal(batch_at(store, fresh, 0, step, b, s)[0], batch_at(store, mix, 0, step, b, s)[0])
    # phase configs: the first at its length unscaled, the second at the model's with RoPE x4 from 8
    p0, p1 = phase_config(cfg, 0), phase_config(cfg, 1)
    assert (p0.model.seq_len, p0.train.batch_size, rope_scaling_of(p0.model)) == (8, 16, ("none", 1.0, 8))
    assert (p1.model.seq_len, p1.train.batch_size, rope_scaling_of(p1.model)) == (32, 4, ("ntk", 4.0, 8))
    assert final_model(cfg) == p1.model  # what sampling, task evaluations and the export use


@pytest.mark.parametrize(
    "lens, starts, says",
    [
        ("[8,32,32]", "[0.0,0.5]", "give 1 length or one per phase"),
        ("[32,8]", "[0.0,0.5]", "must not fall"),
        ("[8,16]", "[0.0,0.5]", "the longest must equal model.seq_len=32"),
        ("[12,32]", "[0.0,0.5]", "12 must divide model.seq_len=32"),
    ],
)
def test_bad_phase_lengths_are_refused_in_one_line(lens, starts, says):
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", MICRO + [f"data.phase_seq_lens={lens}", f"data.phase_starts={starts}"])
    assert len(exc.value.errors) == 1 and says in exc.value.errors[0] and "data.phase_seq_lens" in exc.value.errors[0]


@pytest.mark.slow  # over 10 s: `make test-all` (CI) runs it; make test measured 16:24 with it
def test_a_run_resumed_across_the_context_change_equals_the_uninterrupted_one(corpus, tmp_path):
    cfg = load_config("tiny", MICRO + [f"data.sources=[{corpus['code']}]", "train.steps=12", "train.checkpoint_every=4",
                                       "data.phase_starts=[0.0,0.5]", "data.phase_seq_lens=[16,32]",
                                       "train.eval_every=6"])  # fmt: skip
    whole = tmp_path / "whole"
    train(cfg, whole, progress=False)
    cut = tmp_path / "cut"
    with pytest.raises(Exception, match="stopped at step 5"):
        train(cfg, cut, progress=False, stop=lambda: len(read_jsonl(RunDir(cut).metrics)) >= 6)  # after step 5's log
    train(None, cut, resume=True, progress=False)  # from step 4, across the change at step 6

    def trail(run):
        return [(r["kind"], r["step"], r.get("loss"), r.get("seq_len")) for r in read_jsonl(RunDir(run).metrics)]

    assert trail(cut) == trail(whole)
    assert [r[3] for r in trail(whole) if r[0] == "eval"] == [16, 16, 32]  # evals at 0, 6 (after step 5) | 12
    ctx = [(e["step"], e["seq_len"], e["sequences"]) for e in read_jsonl(RunDir(whole).path / "events.jsonl")
           if e["event"] == "context"]  # fmt: skip
    assert ctx == [(0, 16, 8), (6, 32, 4)]
    from moelab.report.site import run_plots  # the site marks the change once, not the resume

    loss = dict(run_plots(cut))["loss"]
    assert loss.count("32 tokens from here") == 1 and "16 tokens from here" not in loss
