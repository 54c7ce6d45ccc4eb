"""Accounting against Marin's published figures and against the parameters a model really has."""

from __future__ import annotations

import json

import jax
import pytest

from conftest import run_cli
from moelab import accounting
from moelab.config import load_config
from moelab.model import count_params, init_params

REL = 0.005  # the bar: every published number within 0.5%


def test_hero_reproduces_every_published_number(marin):
    hero = marin["hero"]
    cfg = load_config("marin-535b-a23b")
    tokens = hero["tokens_per_step"] * hero["steps"]
    assert cfg.train.batch_size * cfg.model.seq_len == hero["tokens_per_step"]
    assert cfg.train.steps == hero["steps"]
    out = accounting.count(cfg).train(accounting.run_tokens(cfg))
    exp = hero["expected"]
    assert out["tokens"] == pytest.approx(tokens)
    pairs = {
        "active_params": "active_params",
        "total_params_nonembedding": "total_params_nonembedding",
        "total_params": "total_params",
        "train_flops_without_lm_head": "train_flops_without_lm_head",
        "train_flops": "train_flops_with_lm_head",
        "six_n_d": "six_N_D",
        "tokens": "tokens",
    }
    for ours, theirs in pairs.items():
        assert out[ours] == pytest.approx(exp[theirs], rel=REL), ours
    # the headline figures from the issue: 535.3B total, 22.76B active, 2.70e24 / 2.61e24 FLOPs
    assert round(out["total_params"] / 1e9, 1) == 535.3
    assert round(out["active_params"] / 1e9, 2) == 22.76
    assert round(out["train_flops"] / 1e24, 2) == 2.70
    assert round(out["train_flops_without_lm_head"] / 1e24, 2) == 2.61


@pytest.mark.parametrize("rung", ["d768", "d1024", "d1536", "d2048"])
def test_ladder_rung_reproduces_published_numbers(marin, rung):
    ref = next(r for r in marin["ladder"] if r["name"] == rung)
    cfg = load_config(f"marin-ladder-{rung}")
    assert cfg.train.batch_size == 1024 * ref["racks"] and cfg.train.steps == ref["steps"]
    assert (cfg.model.n_kv_heads, cfg.model.kv_heads_local) == (ref["kv_heads_global"], ref["kv_heads_local"])
    out = accounting.count(cfg).train(accounting.run_tokens(cfg))
    assert out["active_params"] == pytest.approx(ref["expected_active"], rel=REL)
    assert out["total_params"] == pytest.approx(ref["expected_total"], rel=REL)
    assert out["train_flops"] == pytest.approx(ref["expected_train_flops_with_lm_head"], rel=REL)
    assert out["train_flops_without_lm_head"] == pytest.approx(ref["expected_train_flops_without_lm_head"], rel=REL)


def test_flops_cli_json_prints_the_hero(marin):
    res = run_cli("flops", "marin-535b-a23b", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for key in (
        "total_params",
        "total_params_nonembedding",
        "active_params",
        "forward_flops_per_token",
        "train_flops",
        "train_flops_without_lm_head",
        "six_n_d",
        "tokens",
    ):
        assert key in out
    assert out["train_flops"] == pytest.approx(marin["hero"]["expected"]["train_flops_with_lm_head"], rel=REL)


def test_flops_cli_token_options():
    base = json.loads(run_cli("flops", "tiny", "--json", "--tokens", "1e9").stdout)
    assert base["tokens"] == 1e9 and base["six_n_d"] == pytest.approx(6 * base["active_params"] * 1e9)
    steps = json.loads(run_cli("flops", "tiny", "--json", "--steps", "10", "--batch-tokens", "1000").stdout)
    assert steps["tokens"] == 10_000 and steps["train_flops"] == pytest.approx(
        3 * steps["forward_flops_per_token"] * 1e4
    )
    res = run_cli("flops", "tiny", "--tokens", "5", "--steps", "3")
    assert res.returncode == 2 and "--tokens" in res.stderr
    text = run_cli("flops", "tiny", "--set", "model.top_k=4")
    assert text.returncode == 0 and "active parameters" in text.stdout


def test_hand_computed_small_config():
    # d=8, 1 layer, 2 heads of 4, 1 kv head, 4 experts top-1 of width 2, no shared, no latent, vocab 10, seq 6
    cfg = load_config(
        {
            "model": dict(
                d_model=8,
                n_layers=1,
                n_heads=2,
                n_kv_heads=1,
                n_routed=4,
                top_k=1,
                expert_dim=2,
                n_shared=0,
                latent_dim=0,
                vocab_size=10,
                seq_len=6,
            )
        }
    )
    a = accounting.count(cfg)
    attn = 2 * 8 * 8 + 2 * 8 * 4  # q, o: d x heads*hd; k, v: d x kv*hd
    router = 8 * 4
    expert = 3 * 8 * 2
    assert a.total_params_nonembedding == attn + router + 4 * expert
    assert a.active_params == attn + router + expert
    assert a.total_params == attn + router + 4 * expert + 2 * 10 * 8
    assert a.forward_flops_per_token_without_lm_head == 2 * (attn + router + expert) + 6 * 2 * (4 * 4 + 3)
    assert a.lm_head_flops_per_token == 2 * 8 * 10


SMALL = [
    ("tiny", []),
    ("tiny-softmax", []),
    ("tiny", ["model.n_shared=0", "model.latent_dim=0"]),
    ("tiny", ["model.n_shared=3", "model.shared_dim=24", "model.n_kv_heads=2", "model.n_kv_heads_local=4"]),
    ("tiny", ["model.sliding_window=0", "model.head_dim=16", "model.n_routed=16", "model.top_k=4"]),
]


@pytest.mark.parametrize("name,overrides", SMALL)
def test_initialised_model_has_the_counted_parameters(name, overrides):
    cfg = load_config(name, overrides)
    a = accounting.count(cfg)
    params = init_params(cfg.model, jax.random.PRNGKey(0))
    assert count_params(params) == a.total_params + a.norm_params


@pytest.mark.parametrize("name", ["marin-ladder-d768", "marin-ladder-d2048", "marin-535b-a23b"])
def test_marin_shapes_have_the_counted_parameters(name):
    """The full-size models, by shape only (nothing is allocated)."""
    cfg = load_config(name)
    shapes = jax.eval_shape(lambda k: init_params(cfg.model, k), jax.random.PRNGKey(0))
    a = accounting.count(cfg)
    assert count_params(shapes) == a.total_params + a.norm_params


def test_a_long_context_phase_is_counted_at_its_own_length():
    """A run of 128 then 512 tokens a sequence (the batch's tokens held) costs its phases' tokens at
    each length's FLOPs per token: the same as the two plain configs' rates (hand sum)."""
    from moelab.accounting import count, run_train
    from moelab.config import load_config

    sets = ["model.seq_len=512", "train.steps=100", "train.batch_size=4", "data.phase_starts=[0.0,0.75]"]
    phased = run_train(load_config("tiny", sets + ["data.phase_seq_lens=[128,512]"]))
    short = count(load_config("tiny", ["model.seq_len=128"])).forward_flops_per_token
    long = count(load_config("tiny", ["model.seq_len=512"])).forward_flops_per_token
    tokens = 100 * 4 * 512
    assert phased["tokens"] == tokens
    assert [p["steps"] for p in phased["phases"]] == [75, 25]
    assert phased["train_flops"] == pytest.approx(3 * (short * 0.75 + long * 0.25) * tokens, rel=1e-12)
    assert short < long  # attention's span: the sums differ from one length's count
