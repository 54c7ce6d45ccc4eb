"""The sharding rules (parallel/mesh.py) and FSDP on 8 simulated CPU devices: the train step's
loss, gradients and new state equal the single-device step's, and checkpoints move between
sharded and unsharded states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO
from moelab.config import load_config
from moelab.model import loss_fn
from moelab.parallel import mesh as pmesh
from moelab.train import checkpoint, optim
from moelab.train.step import init_train_state, make_train_step


def test_rules_by_hand():
    sizes = {"data": 4, "expert": 2}
    both = ("data", "expert")
    # FSDP: d_model over every device when it divides; experts over expert, their hidden dim over data
    assert pmesh.axes_for("wq", (3, 64, 128), sizes, True) == (None, both, None)
    assert pmesh.axes_for("wo", (3, 128, 64), sizes, True) == (None, None, both)
    assert pmesh.axes_for("w_gate", (3, 8, 32, 16), sizes, True) == (None, "expert", "data", None)
    assert pmesh.axes_for("w_down", (3, 8, 16, 32), sizes, True) == (None, "expert", "data", None)
    assert pmesh.axes_for("embed", (512, 64), sizes, True) == (None, both)
    assert pmesh.axes_for("head", (64, 512), sizes, True) == (both, None)
    # one layer's slice of a stacked weight keeps its names; norms, router output and bias stay whole
    assert pmesh.axes_for("w_up", (8, 32, 16), sizes, True) == ("expert", "data", None)
    assert pmesh.axes_for("attn_norm", (3, 64), sizes, True) == (None, None)
    assert pmesh.axes_for("router", (3, 64, 8), sizes, True) == (None, both, None)
    assert pmesh.axes_for("router_bias", (3, 8), sizes, True) == (None, None)
    # the next candidate when an axis does not divide: d 12 over data (4), d 6 over expert (2), d 7 whole;
    # an expert whose input dim does not divide shards its hidden dim; an unknown leaf is replicated
    assert pmesh.axes_for("wq", (3, 12, 128), sizes, True) == (None, "data", None)
    assert pmesh.axes_for("wq", (3, 6, 128), sizes, True) == (None, "expert", None)
    assert pmesh.axes_for("wq", (3, 7, 128), sizes, True) == (None, None, None)
    assert pmesh.axes_for("w_gate", (3, 8, 6, 16), sizes, True) == (None, "expert", None, "data")
    assert pmesh.axes_for("w_gate", (3, 7, 6, 16), sizes, True) == (None, None, None, "data")
    assert pmesh.axes_for("count", (), sizes, True) == ()
    # without FSDP (the rules before it): experts over expert, the rest replicated
    assert pmesh.axes_for("w_gate", (3, 8, 32, 16), sizes, False) == (None, "expert", None, None)
    assert pmesh.axes_for("wq", (3, 64, 128), sizes, False) == (None, None, None)
    assert pmesh.shards_of((None, "expert", "data", None), sizes) == 8
    assert pmesh.shards_of((None, both, None), sizes) == 8


def _batch(cfg, seed):
    shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
    return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), shape, 0, cfg.model.vocab_size), np.int32)


CASES = {
    "plain": ["model.latent_dim=0", "model.n_shared=0"],
    "latent-shared": [],
    "muon": ["train.optimizer=muon"],
}


@pytest.mark.parametrize(
    "shape,case",
    [
        pytest.param((8, 1), "latent-shared", marks=pytest.mark.slow),
        # by default FSDP is checked on a 4 x 2 mesh by training (tests/test_ep.py, latent and shared experts)
        pytest.param((2, 4), "latent-shared", marks=pytest.mark.slow),
        pytest.param((4, 2), "plain", marks=pytest.mark.slow),
        pytest.param((4, 2), "muon", marks=pytest.mark.slow),
    ],
    ids=["8x1-latent-shared", "2x4-latent-shared", "4x2-plain", "4x2-muon"],
)
def test_fsdp_step_equals_single_device(shape, case):
    """One train step from a warmed-up state (Adam's first step divides by |g| and would magnify
    rounding): loss, gradients and every leaf of the new state within 1e-5 of one device's."""
    sets = MICRO + ["train.batch_size=8", "model.dispatch=dropless", "model.eval_dispatch="] + CASES[case]
    cfg = load_config("tiny", sets)
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    one = make_train_step(cfg, opt, h)
    state = init_train_state(cfg, opt)
    for s in range(3):
        state, _ = one(state, _batch(cfg, s), np.int32(s))
    host = jax.device_get(state)
    batch = _batch(cfg, 9)

    def grads_of(params, model_state, b, runtime=pmesh.ONE):
        return jax.grad(lambda p: loss_fn(p, model_state, b[:, :-1], b[:, 1:], cfg.model, runtime=runtime)[0])(params)

    g_ref = jax.jit(grads_of)(host["params"], host["model_state"], batch)
    ref, m_ref = one(jax.tree.map(jnp.asarray, host), batch, np.int32(3))

    mesh = pmesh.auto_mesh(*shape)
    sharded = pmesh.shard_tree(jax.tree.map(jnp.asarray, host), mesh, fsdp=True)
    wq = sharded["params"]["layers"]["wq"]  # FSDP is on: each device holds 1/8 of d_model
    assert wq.addressable_shards[0].data.shape[1] == cfg.model.d_model // 8
    shardings = jax.tree.map(lambda x: x.sharding, sharded)
    b = pmesh.put_batch(batch, mesh)
    fsdp = pmesh.Runtime(mesh, fsdp=True)
    g = jax.jit(lambda p, s, b: grads_of(p, s, b, fsdp))(sharded["params"], sharded["model_state"], b)
    step = make_train_step(cfg, opt, h, shardings)
    new, m = step(sharded, b, np.int32(3))

    assert float(m["loss"]) == pytest.approx(float(m_ref["loss"]), abs=1e-5)
    for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    # and the new state stays where the rules put it
    for leaf, sh in zip(jax.tree.leaves(new), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)


@pytest.mark.parametrize("saved,restored", [((4, 2), None), (None, (2, 4)), ((2, 4), (8, 1))],
                         ids=["fsdp-to-one", "one-to-fsdp", "fsdp-to-fsdp"])  # fmt: skip
def test_fsdp_checkpoints_restore_across_meshes(tmp_path, saved, restored):
    cfg = load_config("tiny", MICRO + ["train.batch_size=8", "train.seed=3"])
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)

    def state_on(shape, seed):
        state = init_train_state(load_config(cfg, [f"train.seed={seed}"]), opt)
        return state if shape is None else pmesh.shard_tree(state, pmesh.auto_mesh(*shape), fsdp=True)

    state = state_on(saved, 3)
    checkpoint.save(tmp_path / "ckpt", 10, state, {"step": 10}, keep_last=1, keep_every=0)
    template = state_on(restored, 4)  # another seed: only shapes and placements come from the template
    back, _ = checkpoint.restore(tmp_path / "ckpt", 10, template)
    for a, b, t in zip(jax.tree.leaves(state), jax.tree.leaves(back), jax.tree.leaves(template), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.is_equivalent_to(t.sharding, b.ndim)
    wq = back["params"]["layers"]["wq"]
    want = cfg.model.d_model // (1 if restored is None else 8)
    assert wq.addressable_shards[0].data.shape[1] == want


@pytest.mark.parametrize("shape", [(2, 4), pytest.param((8, 1), marks=pytest.mark.slow)], ids=["2x4", "8x1"])
def test_evaluation_under_the_mesh_equals_one_device(shape):
    """The held-out loss computed under the training mesh (FSDP gathers, the transports for EP,
    dropless) equals one device's: the summed nats and the count of a masked batch."""
    from moelab.train.step import make_eval_step

    cfg = load_config("tiny", MICRO + ["train.batch_size=8", "model.capacity_factor=8.0"])
    h = optim.hyper(cfg)
    state = init_train_state(cfg, optim.make_optimizer(cfg, h))
    rows = _batch(cfg, 11)
    mask = np.ones((8, cfg.model.seq_len), np.float32)
    mask[3, 5:] = 0.0  # a padded window
    nll = make_eval_step(cfg)
    want = {d: nll(state["params"], state["model_state"], rows[:, :-1], rows[:, 1:], mask, dispatch=d)
            for d in ("dropless", "capacity")}  # fmt: skip
    mesh = pmesh.auto_mesh(*shape)
    sharded = pmesh.shard_tree(state, mesh, fsdp=True)
    nll = make_eval_step(cfg, mesh)
    args = [pmesh.put_batch(np.ascontiguousarray(a), mesh) for a in (rows[:, :-1], rows[:, 1:], mask)]
    for d, (total, count) in want.items():
        got_total, got_count = nll(sharded["params"], sharded["model_state"], *args, dispatch=d)
        assert float(got_count) == float(count)
        assert float(got_total) == pytest.approx(float(total), rel=1e-5), d
