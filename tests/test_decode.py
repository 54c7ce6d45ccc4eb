"""Generation with a KV cache against the full forward, and sampling against hand-computed cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import load_config
from moelab.errors import UsageError
from moelab.model import init_params
from moelab.model.decode import Generator, cache_slots, pick
from moelab.model.transformer import forward as full_forward
from moelab.model.transformer import logits_of


def windowed_lm(**model):
    """Local layers with a window of 5 and their own kv heads, a latent MoE, a sigmoid router with a bias."""
    base = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=1, n_kv_heads_local=2, vocab_size=64, seq_len=24,
                sliding_window=5, global_every=2, n_routed=4, top_k=2, expert_dim=16, shared_dim=16, latent_dim=16,
                router="sigmoid", routed_scale=2.0, rope_fraction=0.5, dispatch="capacity", eval_dispatch="dropless")  # fmt: skip
    base.update(model)
    m = load_config({"model": base}).model
    params = init_params(m, jax.random.PRNGKey(0))
    params["embed"] = params["embed"] * 3.0  # sharper logits: greedy paths that do not repeat one token
    state = {"router_bias": jax.random.normal(jax.random.PRNGKey(1), (m.n_layers, m.n_routed))}
    return m, params, state


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"router": "softmax", "latent_dim": 0, "sliding_window": 0, "n_kv_heads": 2},
        {"rope_original_len": 6, "rope_scaling": "yarn"},  # a model after a context extension (RoPE x4)
    ],
)
def test_cached_logits_equal_the_full_forward_at_every_generated_position(model):
    """Greedy generation with the cache, 17 new tokens after a 4-token prompt (past the window of 5):
    at every position the logits equal those of the full forward over the whole sequence."""
    m, params, state = windowed_lm(**model)
    assert cache_slots(m, m.seq_len)[:2] == ([5, 24] if m.sliding_window else [24, 24])
    prompt = [3, 17, 42, 8]
    new, logits = Generator(params, state, m).generate(prompt, max_new=17, keep_logits=True)
    assert len(new) == 17
    seq = jnp.asarray([prompt + new], jnp.int32)
    hidden = jax.jit(lambda p, t: full_forward(p, state, t, m, "dropless")[0])(params, seq)
    ref = np.asarray(logits_of(params, hidden))[0]
    for j, got in enumerate(logits):  # logits[j] predicts the token after position len(prompt) - 1 + j
        np.testing.assert_allclose(got, ref[len(prompt) - 1 + j], atol=1e-5, rtol=1e-5)
        assert new[j] == int(np.argmax(ref[len(prompt) - 1 + j]))
    assert len(set(new)) > 3  # a real path, not one token repeated


def test_a_chunked_prefill_gives_the_whole_prefill_s_logits():
    """A 23-token prompt prefilled in pieces (16 + 4 + 1 + 1 + 1, past the window of 5) continues with the
    logits of the prompt prefilled at once; ``until`` ends the generation where it says."""
    m, params, state = windowed_lm()
    gen = Generator(params, state, m)
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, 64, 23)]
    whole, lw = gen.generate(prompt, max_new=1, keep_logits=True)
    parts, lp = gen.generate(prompt, max_new=1, keep_logits=True, chunked=True)
    assert whole == parts
    np.testing.assert_allclose(lp[0], lw[0], atol=1e-5, rtol=1e-5)
    new, _ = gen.generate(prompt[:5], max_new=10)
    assert gen.generate(prompt[:5], max_new=10, until=lambda out: len(out) >= 3)[0] == new[:3]


def test_generation_stops_at_the_context_and_at_the_stop_token():
    m, params, state = windowed_lm(seq_len=12)
    gen = Generator(params, state, m)
    new, _ = gen.generate([1, 2, 3], max_new=50)
    assert len(new) == 12 - 3 + 1  # inputs fill positions 0..11; the last one still predicts a token
    first = new[0]
    assert gen.generate([1, 2, 3], max_new=50, stop=first)[0] == [first]
    with pytest.raises(UsageError, match="--prompt: 13 tokens, the model's context is 12"):
        gen.generate(list(range(13)), max_new=1)
    with pytest.raises(UsageError, match="--top-p"):
        gen.generate([1], max_new=1, temperature=1.0, top_p=0.0)


def test_sampling_follows_temperature_top_k_and_top_p():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    rng = np.random.default_rng(0)
    assert pick(logits, rng, 0.0) == 1
    assert {pick(logits, rng, 1.0, top_k=1) for _ in range(20)} == {1}
    # top_p 0.6: the likeliest (0.4) then 0.3 reach 0.7 >= 0.6; 0.2 and 0.1 never drawn
    draws = [pick(logits, rng, 1.0, top_p=0.6) for _ in range(2000)]
    assert set(draws) == {1, 3}
    assert np.mean(np.array(draws) == 1) == pytest.approx(0.4 / 0.7, abs=0.03)
    # temperature 1 with no cut: the distribution itself
    draws = np.array([pick(logits, rng, 1.0) for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, [0.1, 0.4, 0.2, 0.3], atol=0.025)
    # a high temperature flattens it
    draws = np.array([pick(logits, rng, 100.0) for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, 0.25, atol=0.03)


def test_the_same_seed_gives_the_same_sample():
    m, params, state = windowed_lm()
    gen = Generator(params, state, m)
    a = gen.generate([5, 6], max_new=10, temperature=1.0, top_p=0.9, seed=7)[0]
    assert a == gen.generate([5, 6], max_new=10, temperature=1.0, top_p=0.9, seed=7)[0]
    assert a != gen.generate([5, 6], max_new=10, temperature=1.0, top_p=0.9, seed=8)[0]
