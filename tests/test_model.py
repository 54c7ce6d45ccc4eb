"""The language model: attention against a loop reference, masks, losses, overfitting one batch."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy.special import logsumexp

from conftest import MOE_IMPL, MOE_SET
from moelab.config import load_config
from moelab.model import forward, init_params, init_state, loss_fn
from moelab.model.layers import attention, rms_norm, rope
from moelab.model.transformer import logits_of
from reference import attention_reference, forward_reference, jaxpr_eqns, rope_reference


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_matches_pairwise_rotation(fraction):
    x = np.random.default_rng(0).normal(size=(1, 5, 2, 8)).astype(np.float32)
    out = rope(jnp.asarray(x), jnp.arange(5), fraction, 100.0)
    np.testing.assert_allclose(out, rope_reference(x, fraction, 100.0), atol=1e-5)
    # rotation keeps each pair's length
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


@pytest.mark.parametrize("impl", ["blocked", "flash", "xla"])
@pytest.mark.parametrize(
    "window,kv_alloc,kv,fraction",
    [(0, 2, 2, 1.0), (3, 2, 2, 0.5), (0, 4, 1, 1.0), (4, 4, 2, 0.5)],
)
def test_attention_matches_loop_reference(window, kv_alloc, kv, fraction, impl):
    """Each path (moelab's blocked one; jax.nn.dot_product_attention, whose cudnn kernel GPUs use)
    against a loop over positions, with the window and grouped kv heads."""
    d, heads, hd, s = 16, 4, 4, 7
    rng = np.random.default_rng(1)
    p = {
        "wq": rng.normal(size=(d, heads * hd)) / 4,
        "wk": rng.normal(size=(d, kv_alloc * hd)) / 4,
        "wv": rng.normal(size=(d, kv_alloc * hd)) / 4,
        "wo": rng.normal(size=(heads * hd, d)) / 4,
    }
    x = rng.normal(size=(2, s, d))
    kw = dict(n_heads=heads, head_dim=hd, window=window, rope_fraction=fraction, rope_theta=1000.0)
    fast = attention(
        {k: jnp.asarray(v, jnp.float32) for k, v in p.items()},
        jnp.asarray(x, jnp.float32),
        n_kv_alloc=kv_alloc,
        n_kv=kv,
        eps=1e-6,
        impl=impl,
        **kw,
    )
    np.testing.assert_allclose(fast, attention_reference(p, x, n_kv=kv, **kw), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window,kv", [(0, 2), pytest.param(5, 1, marks=pytest.mark.slow)])
def test_attention_paths_have_the_same_gradients(window, kv):
    rng = np.random.default_rng(2)
    d, heads, hd = 16, 4, 8
    p = {k: jnp.asarray(rng.normal(size=shape) / 4, jnp.float32) for k, shape in
         (("wq", (d, heads * hd)), ("wk", (d, kv * hd)), ("wv", (d, kv * hd)), ("wo", (heads * hd, d)))}  # fmt: skip
    x = jnp.asarray(rng.normal(size=(2, 12, d)), jnp.float32)
    kw = dict(n_heads=heads, n_kv_alloc=kv, n_kv=kv, head_dim=hd, window=window, rope_fraction=0.5,
              rope_theta=1000.0, eps=1e-6)  # fmt: skip

    def grads(impl):
        return jax.grad(lambda p, x: jnp.sum(attention(p, x, impl=impl, **kw) ** 2), argnums=(0, 1))(p, x)

    for a, b in zip(jax.tree.leaves(grads("xla")), jax.tree.leaves(grads("blocked")), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "window,kv,s,block",
    [
        pytest.param(0, 2, 7, 2, marks=pytest.mark.slow),
        (3, 1, 11, 4),
        pytest.param(6, 2, 24, 8, marks=pytest.mark.slow),
    ],
)
def test_flash_attention_in_many_blocks_equals_the_reference_and_its_gradients(window, kv, s, block):
    """The flash path with blocks much smaller than the sequence (several key blocks per query
    block, a window that starts inside a block, a padded last block): the loop reference forward,
    the xla path's gradients."""
    rng = np.random.default_rng(3)
    d, heads, hd = 16, 4, 8
    p = {k: jnp.asarray(rng.normal(size=shape) / 4, jnp.float32) for k, shape in
         (("wq", (d, heads * hd)), ("wk", (d, kv * hd)), ("wv", (d, kv * hd)), ("wo", (heads * hd, d)))}  # fmt: skip
    x = jnp.asarray(rng.normal(size=(2, s, d)), jnp.float32)
    kw = dict(n_heads=heads, head_dim=hd, window=window, rope_fraction=0.5, rope_theta=1000.0)
    out = attention(p, x, n_kv_alloc=kv, n_kv=kv, eps=1e-6, impl="flash", flash_block=block, **kw)
    np.testing.assert_allclose(out, attention_reference(p, x, n_kv=kv, **kw), atol=2e-5, rtol=1e-4)

    def grads(impl):
        def f(p, x):
            return jnp.sum(
                jnp.sin(attention(p, x, n_kv_alloc=kv, n_kv=kv, eps=1e-6, impl=impl, flash_block=block, **kw))
            )

        return jax.grad(f, argnums=(0, 1))(p, x)

    for a, b in zip(jax.tree.leaves(grads("flash")), jax.tree.leaves(grads("xla")), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_flash_attention_keeps_no_sequence_by_sequence_buffer():
    """Forward and backward at 1024 tokens in blocks of 128: no value in the program holds an
    eighth of one head's [s, s] scores; the blocked path (the check's own control) does."""
    s, d, heads, hd = 1024, 16, 2, 8
    rng = np.random.default_rng(4)
    p = {k: jnp.asarray(rng.normal(size=shape) / 4, jnp.float32) for k, shape in
         (("wq", (d, heads * hd)), ("wk", (d, hd)), ("wv", (d, hd)), ("wo", (heads * hd, d)))}  # fmt: skip
    x = jnp.asarray(rng.normal(size=(1, s, d)), jnp.float32)
    kw = dict(n_heads=heads, n_kv_alloc=1, n_kv=1, head_dim=hd, window=0, rope_fraction=1.0, rope_theta=1e4, eps=1e-6)

    def largest(impl):
        f = lambda p, x: jnp.sum(attention(p, x, impl=impl, flash_block=128, **kw) ** 2)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(p, x).jaxpr
        return max(math.prod(v.aval.shape) for e in jaxpr_eqns(jaxpr) for v in e.outvars if hasattr(v.aval, "shape"))

    assert largest("flash") < s * s // 8
    assert largest("blocked") >= s * s // 8


# the model jitted: run op by op, a small model's forward takes seconds of dispatch
jforward = jax.jit(forward, static_argnums=(3, 4, 5))


def small_lm(**model):
    base = dict(
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        seq_len=16,
        n_routed=4,
        top_k=2,
        expert_dim=16,
        shared_dim=16,
        dispatch="dropless",
    )
    if MOE_IMPL:
        base["moe_impl"] = MOE_IMPL
    base.update(model)
    m = load_config({"model": base}).model
    return m, init_params(m, jax.random.PRNGKey(0)), init_state(m)


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_causal_and_windowed():
    """A later token never changes an earlier output; in one windowed layer, nothing beyond the window does."""
    m, p, st = small_lm(n_layers=2, sliding_window=4, global_every=0)
    assert [m.is_global(i) for i in range(2)] == [False, True]  # the last layer is always global
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 16), 0, 64)
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 64)
    h1, h2 = jforward(p, st, tokens, m)[0], jforward(p, st, changed, m)[0]
    np.testing.assert_array_equal(h1[0, :10], h2[0, :10])
    assert not np.allclose(h1[0, 10:], h2[0, 10:])

    # the local layer's attention alone: window 4 hides position 10 from positions >= 14
    lp = jax.tree.map(lambda a: a[0], p["layers"])
    x1 = rms_norm(p["embed"][tokens], lp["attn_norm"])
    x2 = rms_norm(p["embed"][changed], lp["attn_norm"])
    kw = dict(n_heads=4, n_kv_alloc=2, n_kv=2, head_dim=8, window=4, rope_fraction=1.0, rope_theta=1e4, eps=1e-6)
    a1, a2 = attention(lp, x1, **kw), attention(lp, x2, **kw)
    np.testing.assert_array_equal(a1[0, 14:], a2[0, 14:])
    assert not np.allclose(a1[0, 10:14], a2[0, 10:14])


@pytest.mark.slow  # 12 s (make test under 15 minutes; CI's make test-all runs it)
def test_loss_terms_match_their_formulas():
    m, p, st = small_lm(logit_z_loss=0.5, aux_loss_coef=0.0, router_z_loss_coef=0.0)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 17), 0, 64)
    loss, (metrics, _) = loss_fn(p, st, tokens[:, :-1], tokens[:, 1:], m)
    hidden = jforward(p, st, tokens[:, :-1], m)[0]
    logits = np.asarray(logits_of(p, hidden), np.float64)
    lse = logsumexp(logits, axis=-1)
    target = np.take_along_axis(logits, np.asarray(tokens[:, 1:])[..., None], -1)[..., 0]
    ce = np.mean(lse - target)
    assert float(metrics["ce"]) == pytest.approx(ce, rel=1e-5)
    assert float(metrics["logit_z"]) == pytest.approx(np.mean(lse**2), rel=1e-5)
    assert float(loss) == pytest.approx(ce + 0.5 * np.mean(lse**2), rel=1e-5)

    m2 = dataclasses.replace(m, aux_loss_coef=0.1, router_z_loss_coef=0.01)
    loss2, _ = loss_fn(p, st, tokens[:, :-1], tokens[:, 1:], m2)
    # the router terms by hand from each layer's router logits (the MoE inputs captured): the Switch
    # loss E * sum_e f_e P_e over top-k assignments, and the mean squared log-partition
    moe_in = np.asarray(jforward(p, st, tokens[:, :-1], m, capture=True)[1]["moe_input"], np.float64)
    aux, rz = [], []
    for i in range(m.n_layers):
        logits = moe_in[i].reshape(-1, m.d_model) @ np.asarray(p["layers"]["router"][i], np.float64)
        probs = np.exp(logits - logsumexp(logits, axis=-1, keepdims=True))  # softmax router
        top = np.argsort(-logits, axis=-1)[:, : m.top_k]
        f = np.bincount(top.ravel(), minlength=m.n_routed) / top.size
        aux.append(m.n_routed * np.sum(f * probs.mean(axis=0)))
        rz.append(np.mean(logsumexp(logits, axis=-1) ** 2))
    assert m.router == "softmax"
    assert float(loss2) == pytest.approx(float(loss) + 0.1 * np.mean(aux) + 0.01 * np.mean(rz), rel=1e-5)


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_eval_dispatch_runs_dropless():
    m, p, st = small_lm(dispatch="capacity", capacity_factor=0.5, eval_dispatch="dropless")
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 17), 0, 64)
    _, (train_m, _) = loss_fn(p, st, tokens[:, :-1], tokens[:, 1:], m, train=True)
    _, (eval_m, _) = loss_fn(p, st, tokens[:, :-1], tokens[:, 1:], m, train=False)
    assert float(jnp.min(train_m["layers"]["dropped_frac"])) > 0
    assert float(jnp.max(eval_m["layers"]["dropped_frac"])) == 0


def test_metrics_per_layer_have_their_shapes():
    m, p, st = small_lm(router="sigmoid", bias_update="quantile", dispatch="spill", capacity_factor=1.0)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 17), 0, 64)
    _, (metrics, new_state) = loss_fn(p, st, tokens[:, :-1], tokens[:, 1:], m)
    lay = metrics["layers"]
    for key in ("dropped_frac", "spilled_frac", "max_mean_load", "router_entropy", "router_z", "bias_mean", "bias_std"):
        assert lay[key].shape == (2,), key
    assert lay["tokens_per_expert"].shape == (2, 4) and lay["expert_load"].shape == (2, 4)
    # every assignment is either computed somewhere or dropped
    total = 2 * 16 * 2
    np.testing.assert_allclose(lay["tokens_per_expert"].sum(1), total * (1 - lay["dropped_frac"]), rtol=1e-6)
    np.testing.assert_allclose(lay["expert_load"].sum(1), total)
    assert new_state["router_bias"].shape == (2, 4) and float(jnp.abs(new_state["router_bias"]).sum()) > 0


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_bf16_compute_is_close_to_fp32():
    from moelab.model.moe import moe_block
    from moelab.model.transformer import FP32_PARAMS

    m, p, st = small_lm()
    m16 = dataclasses.replace(m, compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 17), 0, 64)
    l32 = loss_fn(p, st, tokens[:, :-1], tokens[:, 1:], m)[0]
    l16 = loss_fn(p, st, tokens[:, :-1], tokens[:, 1:], m16)[0]
    assert np.isfinite(float(l16)) and float(l16) == pytest.approx(float(l32), rel=2e-2)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    # the hidden states, and each MoE block's own output, not only the loss: a block that returned
    # zeros in bf16 would move these by 100%
    h32, h16 = jforward(p, st, tokens[:, :-1], m)[0], jforward(p, st, tokens[:, :-1], m16)[0]
    assert rel(h16, h32) < 8e-2  # bf16 keeps about 3 digits; over two layers about 4% here
    x = jax.random.normal(jax.random.PRNGKey(6), (2, 16, m.d_model))
    for i in range(m.n_layers):
        layer = {k: v[i] for k, v in p["layers"].items()}
        y32 = moe_block(layer, x, st["router_bias"][i], m, "dropless")[0]
        half = {k: v if k in FP32_PARAMS else v.astype(jnp.bfloat16) for k, v in layer.items()}
        y16 = moe_block(half, x.astype(jnp.bfloat16), st["router_bias"][i], m16, "dropless")[0]
        assert y16.dtype == jnp.bfloat16 and float(jnp.linalg.norm(y32)) > 0.1
        assert rel(y16, y32) < 3e-2, i


def test_the_suite_runs_the_moe_path_it_is_asked_for():
    """Under `make test-ragged` (MOELAB_TEST_MOE_IMPL=ragged) the models these tests build run
    ragged_dot; by default (CPU) they do not."""
    m, p, st = small_lm()
    tokens = jnp.zeros((2, m.seq_len), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda p: loss_fn(p, st, tokens, tokens, m)[0])(p))
    assert ("ragged_dot" in jaxpr) == (MOE_IMPL == "ragged")
    cfg = load_config("tiny", MOE_SET)
    assert cfg.model.moe_impl == (MOE_IMPL or "auto")


@pytest.mark.slow  # 14 s: `make test-all` (CI) runs it; the training tests in make test learn too
def test_tiny_overfits_one_batch():
    cfg = load_config("tiny", MOE_SET)
    m = cfg.model
    params, state = init_params(m, jax.random.PRNGKey(0)), init_state(m)
    batch = jax.random.randint(jax.random.PRNGKey(6), (8, m.seq_len + 1), 0, m.vocab_size)
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, state, opt_state):
        (loss, (_, state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, state, batch[:, :-1], batch[:, 1:], m
        )
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(params, updates), state, opt_state, loss

    losses = []
    for _ in range(40):
        params, state, opt_state, loss = step(params, state, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] / 2, losses


def test_forward_equals_layer_by_layer_reference():
    """Window on local layers, their own kv heads, the router bias in use: the whole model against the references."""
    m, p, st = small_lm(
        n_layers=3,
        sliding_window=5,
        global_every=2,
        n_kv_heads=1,
        n_kv_heads_local=2,
        rope_fraction=0.5,
        seq_len=12,
        latent_dim=8,
        router="sigmoid",
        routed_scale=2.0,
    )
    assert [m.is_global(i) for i in range(3)] == [False, True, True]
    st = {"router_bias": jax.random.normal(jax.random.PRNGKey(9), (3, 4)) * 2.0}
    tokens = jax.random.randint(jax.random.PRNGKey(8), (2, 12), 0, 64)
    hidden = jforward(p, st, tokens, m, "dropless")[0]
    np.testing.assert_allclose(hidden, forward_reference(p, st, tokens, m), atol=2e-4, rtol=2e-4)
    # and the bias matters: without it the routing, and so the output, differs
    assert not np.allclose(hidden, jforward(p, init_state(m), tokens, m, "dropless")[0], atol=1e-3)


def test_masked_loss_counts_only_masked_positions():
    m, p, st = small_lm(logit_z_loss=0.0)
    tokens = jax.random.randint(jax.random.PRNGKey(10), (2, 17), 0, 64)
    mask = jnp.zeros((2, 16)).at[0, :5].set(1.0).at[1, 9:].set(1.0)
    loss = float(loss_fn(p, st, tokens[:, :-1], tokens[:, 1:], m, mask=mask)[0])
    logits = np.asarray(logits_of(p, jforward(p, st, tokens[:, :-1], m)[0]), np.float64)
    nll = logsumexp(logits, -1) - np.take_along_axis(logits, np.asarray(tokens[:, 1:])[..., None], -1)[..., 0]
    assert loss == pytest.approx(float(np.sum(nll * np.asarray(mask)) / 12), rel=1e-5)
    # what the mask hides does not move the loss
    other = tokens.at[1, 3].set((tokens[1, 3] + 1) % 64)
    assert float(loss_fn(p, st, tokens[:, :-1], other[:, 1:], m, mask=mask)[0]) == pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("window,n_kv", [(0, 4), (40, 2)])
def test_query_chunked_attention_equals_the_plain_path(window, n_kv):
    """Causal query blocks (keys beyond a block's reach never scored) and one block, with the blocked
    path's hand-written backward, against jax.nn.dot_product_attention's autodiff: values and grads."""
    b, s, d, heads, hd = 2, 96, 32, 4, 8
    keys = jax.random.split(jax.random.PRNGKey(5), 5)
    p = {
        "wq": jax.random.normal(keys[0], (d, heads * hd)) / 6,
        "wk": jax.random.normal(keys[1], (d, n_kv * hd)) / 6,
        "wv": jax.random.normal(keys[2], (d, n_kv * hd)) / 6,
        "wo": jax.random.normal(keys[3], (heads * hd, d)) / 6,
    }
    x = jax.random.normal(keys[4], (b, s, d))
    kw = dict(n_heads=heads, n_kv_alloc=n_kv, n_kv=n_kv, head_dim=hd, window=window, rope_fraction=1.0,
              rope_theta=1e4, eps=1e-6)  # fmt: skip

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def run(p, x, chunks, impl="blocked"):
        f = lambda p, x: jnp.sum(jnp.sin(attention(p, x, query_chunks=chunks, impl=impl, **kw)))  # noqa: E731
        return attention(p, x, query_chunks=chunks, impl=impl, **kw), jax.grad(f, argnums=(0, 1))(p, x)

    ref = run(p, x, 1, "xla")  # autodiff through jax.nn.dot_product_attention: independent of the blocked backward
    for chunks in (1, 3, 4):
        for a, r in zip(jax.tree.leaves(run(p, x, chunks)), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, r, atol=2e-5, rtol=1e-5)


@pytest.mark.slow  # ~21 s; test_moe.py checks the impls against each other by default, make test-ragged the model
def test_every_moe_impl_gives_the_same_model():
    """model.moe_impl: the language model's loss and gradients through ragged_dot (the default on
    GPU and TPU), the batched blocks and the loop agree in fp32; in bf16 ragged_dot runs in the
    model too, close to the blocks'."""
    import dataclasses

    m, p, st = small_lm(latent_dim=8, n_shared=1, router="sigmoid", bias_update="quantile")
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, m.seq_len + 1), 0, m.vocab_size)

    def run(mm):
        fn = jax.jit(jax.value_and_grad(lambda q: loss_fn(q, st, tokens[:, :-1], tokens[:, 1:], mm)[0]))
        return fn(p)

    def jaxpr(impl):
        mm = dataclasses.replace(m, moe_impl=impl)
        return str(jax.make_jaxpr(lambda q: loss_fn(q, st, tokens[:, :-1], tokens[:, 1:], mm)[0])(p))

    assert "ragged_dot" in jaxpr("ragged") and "ragged_dot" not in jaxpr("blocks")  # each path is the one run
    ref_loss, ref_grads = run(dataclasses.replace(m, moe_impl="ragged"))
    for impl in ("blocks", "loop", "auto"):
        loss, grads = run(dataclasses.replace(m, moe_impl=impl))
        assert float(loss) == pytest.approx(float(ref_loss), abs=1e-5), impl
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    bf16 = {impl: float(run(dataclasses.replace(m, moe_impl=impl, compute_dtype="bfloat16"))[0])
            for impl in ("ragged", "blocks")}  # fmt: skip
    assert bf16["ragged"] == pytest.approx(bf16["blocks"], rel=2e-2)
    assert bf16["ragged"] == pytest.approx(float(ref_loss), rel=5e-2)


def test_the_model_through_dot_product_attention_equals_the_blocked_path():
    import dataclasses

    m, p, st = small_lm(sliding_window=4, n_kv_heads=1, n_kv_heads_local=2, global_every=2)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, m.seq_len + 1), 0, m.vocab_size)

    def loss(impl):
        mm = dataclasses.replace(m, attention_impl=impl)
        return float(jax.jit(lambda q: loss_fn(q, st, tokens[:, :-1], tokens[:, 1:], mm)[0])(p))

    assert loss("xla") == pytest.approx(loss("blocked"), abs=1e-5)
    assert loss("auto") == loss("blocked")  # on CPU auto is the blocked path


@pytest.mark.parametrize("layers", [5, pytest.param(2, marks=pytest.mark.slow)])
def test_layers_as_a_scan_equal_unrolled_layers(layers):
    """model.scan_layers: a scan over whole local/global periods (and the rest unrolled) gives the
    unrolled model's loss, metrics, router biases and gradients; 2 layers is too few to scan."""
    import dataclasses

    m, p, st = small_lm(n_layers=layers, sliding_window=4, n_kv_heads=1, n_kv_heads_local=2, global_every=2,
                        router="sigmoid", bias_update="quantile")  # fmt: skip
    tokens = jax.random.randint(jax.random.PRNGKey(6), (2, m.seq_len + 1), 0, m.vocab_size)

    def run(scan):
        mm = dataclasses.replace(m, scan_layers=scan)
        fn = jax.value_and_grad(lambda q: loss_fn(q, st, tokens[:, :-1], tokens[:, 1:], mm), has_aux=True)
        jaxpr = str(jax.make_jaxpr(fn)(p))
        return jax.jit(fn)(p), jaxpr.count(" scan[")

    (ref, ref_grads), scans_ref = run("unrolled")
    (got, grads), scans = run("scan")
    assert (scans > scans_ref) == (layers == 5)  # the layers' own scan (and its transpose), where there are 2 periods
    for a, b in zip(jax.tree.leaves((got, grads)), jax.tree.leaves((ref, ref_grads)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unstacked_layers_have_the_gradients_of_their_slices():
    """transformer.unstack writes its gradient as one stack of the layers' gradients; autodiff of
    plain slicing is the expectation, each layer weighted differently and one layer unused."""
    from moelab.model.transformer import unstack

    rng = np.random.default_rng(3)
    stacked = {"a": jnp.asarray(rng.normal(size=(4, 3, 5)), jnp.float32), "b": jnp.asarray(rng.normal(size=(4, 2)))}

    def f(layers):
        return sum(
            (i + 1.0) * jnp.sum(jnp.sin(p["a"])) + i * jnp.sum(p["b"] ** 3) for i, p in enumerate(layers) if i != 2
        )

    got = jax.grad(lambda s: f(unstack(s)))(stacked)
    want = jax.grad(lambda s: f([jax.tree.map(lambda a, i=i: a[i], s) for i in range(4)]))(stacked)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not np.any(np.asarray(got["a"][2]))


@pytest.mark.parametrize(
    "dtype,dispatch",
    [
        pytest.param("float32", "dropless", marks=pytest.mark.slow),
        # capacity, then spill to the next choices; bf16 the harder case (16 s: slow, so make test stays
        # under 15 minutes; CI's make test-all runs every case)
        pytest.param("bfloat16", "spill", marks=pytest.mark.slow),
        pytest.param("float32", "capacity", marks=pytest.mark.slow),
        pytest.param("bfloat16", "dropless", marks=pytest.mark.slow),
    ],
)
def test_router_logits_at_plus_and_minus_100_give_finite_losses_and_gradients(dtype, dispatch):
    """Issue 25: a sigmoid router whose logits for some tokens all lie below -88 (every score
    underflows in fp32) and for others above +88, with the Switch aux loss's coefficient at 0 and at
    0.01: the loss and every gradient stay finite, and the underflowing tokens' routed gates still
    sum to routed_scale."""
    from moelab.model import router as rt

    for coef in (0.0, 0.01):
        m, p, st = small_lm(router="sigmoid", routed_scale=2.0, compute_dtype=dtype, dispatch=dispatch,
                            aux_loss_coef=coef, router_z_loss_coef=coef, capacity_factor=1.0, spill_choices=1)  # fmt: skip
        # every expert's router column the same direction, 1000x: each token's logits are about equal
        # across experts and far from 0, below -100 for some tokens and above +100 for others
        v = jax.random.normal(jax.random.PRNGKey(1), (m.d_model, 1))
        spread = 1e-3 * jax.random.normal(jax.random.PRNGKey(2), (1, m.n_routed))
        p["layers"]["router"] = jnp.broadcast_to(1e3 * (v + spread), p["layers"]["router"].shape).astype(jnp.float32)
        tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 17), 0, 64)
        step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=4)  # one compile, not op by op
        (loss, (metrics, _)), grads = step(p, st, tokens[:, :-1], tokens[:, 1:], m)
        assert np.isfinite(float(loss)), (coef, float(loss))
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads)), coef
        assert np.isfinite(float(metrics["aux_loss"])) and np.isfinite(float(metrics["layers"]["router_entropy"][0]))
    # the router itself, on logits set by hand, in fp32 and after a round trip through the compute dtype
    logits = jnp.array([[-100.0, -101.0, -103.0, -100.5], [100.0, 101.0, 103.0, 100.5]]).astype(dtype)
    r = rt.route(logits, jnp.zeros(4), m)
    assert np.allclose(np.asarray(jnp.sum(r.gates, axis=-1)), 2.0, rtol=1e-5)
    assert float(r.gates[0, 0]) > float(r.gates[0, 1]) > 0  # in the ratio of the scores, not zeros
    g = jax.grad(lambda x: rt.switch_aux_loss(rt.route(x, jnp.zeros(4), m).log_scores, r.idx, 4))(
        logits.astype(jnp.float32)
    )
    assert bool(jnp.all(jnp.isfinite(g)))


def test_auto_attention_on_a_gpu_picks_cudnn_only_for_the_dtypes_it_takes(monkeypatch):
    """JAX's cuDNN attention accepts only fp16/bf16: `auto` on a GPU in float32 (the default dtype)
    must take moelab's own path, and an explicit cudnn in float32 is refused in one line."""
    from moelab.model import transformer as tr

    m = load_config("tiny").model
    monkeypatch.setattr(tr.jax, "default_backend", lambda: "gpu")  # the backend's answer, simulated
    assert tr.attention_impl(dataclasses.replace(m, compute_dtype="float32"), 128) == "blocked"
    assert tr.attention_impl(dataclasses.replace(m, compute_dtype="float32"), 4096) == "flash"
    for dtype in ("bfloat16", "float16"):
        assert tr.attention_impl(dataclasses.replace(m, compute_dtype=dtype), 128) == "cudnn"
    problems = tr.backend_problems(dataclasses.replace(m, attention_impl="cudnn", compute_dtype="float32"))
    assert len(problems) == 1 and "cudnn takes bfloat16 or float16" in problems[0]
    assert tr.backend_problems(dataclasses.replace(m, attention_impl="cudnn", compute_dtype="bfloat16")) == []


def test_mfu_on_a_gpu_uses_the_peak_of_the_precision_that_runs(monkeypatch):
    """float32 matmuls run as TF32 on NVIDIA tensor cores under JAX's default precision: MFU must be
    against the TF32 peak there (against the float32 peak it could pass 100%), and the float32 peak
    only with model.matmul_precision=highest."""
    import types

    from moelab.train import loop

    monkeypatch.setattr(loop.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(loop.jax, "devices", lambda: [types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")])
    fp32 = load_config("tiny", ["model.compute_dtype=float32"])
    assert loop.matmul_dtype(fp32) == "tensorfloat32"
    assert loop.device_peak(fp32) == (494.5e12, "published tensorfloat32 peak of H100")
    highest = load_config("tiny", ["model.matmul_precision=highest", "model.compute_dtype=float32"])
    assert loop.device_peak(highest) == (67e12, "published float32 peak of H100")
    assert loop.device_peak(load_config("tiny", ["model.compute_dtype=bfloat16"]))[0] == 989e12
    assert loop.matmul_dtype(fp32, backend="cpu") == "float32"


def test_compute_dtype_auto_is_bf16_on_accelerators_and_fp32_on_cpu(monkeypatch):
    """The default compute dtype: bfloat16 on GPU and TPU (parameters and optimizer state stay fp32),
    float32 on CPU; a run records the dtype it resolved to, so a CPU run's hash is what it was before
    the field had auto."""
    import jax

    from moelab.config import config_hash, resolve_dtype
    from moelab.model.transformer import attention_impl
    from moelab.train import optim
    from moelab.train.step import init_train_state

    cfg = load_config("tiny")
    assert cfg.model.compute_dtype == "auto" and cfg.model.dtype == "float32"  # this machine: CPU
    cpu = resolve_dtype(cfg)
    assert cpu.model.compute_dtype == "float32"
    assert config_hash(cpu) == config_hash(load_config("tiny", ["model.compute_dtype=float32"]))
    for backend in ("gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert cfg.model.dtype == "bfloat16" and resolve_dtype(cfg).model.compute_dtype == "bfloat16"
    assert attention_impl(cfg.model, 4096) == "flash"  # tpu: moelab's flash path, not cudnn
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention_impl(cfg.model, 4096) == "cudnn"  # bf16 by default: the fused kernel works
    opt = optim.make_optimizer(cfg, optim.hyper(cfg))
    state = jax.eval_shape(lambda: init_train_state(resolve_dtype(cfg), opt))
    assert {leaf.dtype for leaf in jax.tree.leaves(state)} <= {jnp.dtype("float32"), jnp.dtype("int32")}
