"""Gradient accumulation (``train.micro_batch``): a step of 2 or 4 micro-batches equals the step of
the whole batch (new parameters, optimiser state, router bias and the metrics) wherever the
capacity groups are the same, on one device and on a 2 x 4 expert-parallel mesh; capacity groups
are formed within a micro-batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO, random_batch, run_cli
from moelab.config import ConfigError, load_config
from moelab.parallel import mesh as pmesh
from moelab.train import optim
from moelab.train.step import init_train_state, make_train_step, micro_batches

B = 8
# metrics compared beside the state: the whole batch's cross-entropy, z-losses, drops, loads, aux
METRICS = ("loss", "ce", "logit_z", "router_z_loss", "aux_loss", "dropped_frac_per_layer", "spilled_frac_per_layer",
           "max_mean_load_per_layer", "router_entropy_per_layer", "expert_load", "grad_norm")  # fmt: skip


_batch = random_batch


_WARM: dict = {}


def _warm(sets, batch):
    """A state after 3 whole-batch steps on one device (Adam's first steps divide by |g| and would
    magnify rounding: every variant starts from this one)."""
    key = (tuple(sets), batch)
    if key not in _WARM:
        cfg = load_config("tiny", MICRO + [f"train.batch_size={batch}"] + sets)
        h = optim.hyper(cfg)
        opt = optim.make_optimizer(cfg, h)
        state, step = init_train_state(cfg, opt), make_train_step(cfg, opt, h)
        for s in range(3):
            state, _ = step(state, _batch(cfg, 100 + s), np.int32(s))
        _WARM[key] = jax.device_get(state)
    return _WARM[key]


def _train(sets, micro, mesh_shape=None, steps=2, batch=B, warm=None):
    """The state and metrics after ``steps`` steps from the warm state, of ``tiny`` + MICRO + sets at
    ``micro`` sequences per micro-step (0 = the whole batch), on one device or a mesh."""
    cfg = load_config("tiny", MICRO + [f"train.batch_size={batch}", f"train.micro_batch={micro}"] + sets)
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = jax.tree.map(jnp.asarray, _warm(sets if warm is None else warm, batch))
    shardings = None
    if mesh_shape is not None:
        mesh = pmesh.auto_mesh(*mesh_shape)
        state = pmesh.shard_tree(state, mesh, fsdp=True)
        shardings = jax.tree.map(lambda x: x.sharding, state)
    step = make_train_step(cfg, opt, h, shardings)
    metrics = []
    for s in range(3, 3 + steps):
        batch = _batch(cfg, s)
        if mesh_shape is not None:
            batch = pmesh.put_batch(batch, mesh)
        state, m = step(state, batch, np.int32(s))
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics


def _assert_same(a, b, rtol=1e-5, atol=1e-5):
    (sa, ma), (sb, mb) = a, b
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
    for step_a, step_b in zip(ma, mb, strict=True):
        for key in METRICS:
            np.testing.assert_allclose(np.asarray(step_a[key]), np.asarray(step_b[key]), rtol=rtol, atol=atol,
                                       err_msg=key)  # fmt: skip


def test_micro_batches_keep_each_devices_rows():
    """On 4 devices of 4 rows each, micro-batch i of 2 holds rows 2i, 2i+1 of every device's block."""
    batch = jnp.arange(16 * 3).reshape(16, 3)
    mesh = pmesh.auto_mesh(4, 1)
    got = np.asarray(micro_batches(batch, 2, pmesh.Runtime(mesh).shards))
    rows = [[d * 4 + 2 * i + j for d in range(4) for j in range(2)] for i in range(2)]
    np.testing.assert_array_equal(got, np.asarray(batch)[np.asarray(rows)])
    np.testing.assert_array_equal(np.asarray(micro_batches(batch, 4)), np.asarray(batch).reshape(4, 4, 3))


@pytest.mark.parametrize(
    "sets,micros",
    [
        # quantile bias from every micro-batch's margins (by default on the 2 x 4 mesh below)
        pytest.param(["model.dispatch=dropless"], (2,), marks=pytest.mark.slow),
        pytest.param(["model.dispatch=dropless"], (4,), marks=pytest.mark.slow),
        # capacity dispatch with a group of one sequence (seq_len 32)
        pytest.param([f"model.capacity_group={32}"], (4, 2), marks=pytest.mark.slow),
        pytest.param(
            ["model.dispatch=dropless", "model.bias_update=sign", "model.bias_rate=0.01"],
            (4, 2),
            marks=pytest.mark.slow,
        ),  # summed loads  # fmt: skip
    ],
    ids=["dropless-quantile-4", "dropless-quantile-2", "capacity-one-sequence-groups", "sign-bias"],
)
def test_accumulation_equals_whole_batch_one_device(sets, micros):
    whole = _train(sets, 0)
    for micro in micros:  # sequences per micro-step: 8 / micro micro-batches
        _assert_same(_train(sets, micro), whole)


@pytest.mark.slow  # 15 s a size: `make test-all` (CI) runs it; the one-device accumulation stays in make test
@pytest.mark.parametrize("micro", [8, 16])
def test_accumulation_equals_whole_batch_on_ep_mesh(micro):
    """2 x 4 mesh (FSDP over data, 8 experts over 4 devices, the fixed transport), dropless: 4 (and 2)
    micro-batches of the 32 sequences give the whole batch's step (each micro-batch splits over the 8
    devices). Capacity dispatch under EP groups a device's tokens, which a micro-batch changes."""
    sets = ["model.dispatch=dropless"]
    _assert_same(_train(sets, micro, (2, 4), steps=1, batch=32), _train(sets, 0, (2, 4), steps=1, batch=32))


@pytest.mark.slow
def test_capacity_groups_form_within_a_micro_batch():
    """capacity_group 0 is a device's tokens of the micro-batch: with 2 micro-batches of 4 sequences on
    one device the step equals the whole batch's with groups of 4 sequences; not the whole batch's
    with one group of all 8 (the drops differ)."""
    tight = ["model.capacity_factor=0.6"]
    micro = _train(tight, 4)
    _assert_same(micro, _train(tight + [f"model.capacity_group={4 * 32}"], 0, warm=tight))
    whole = _train(tight, 0)
    assert not np.allclose(micro[1][0]["dropped_frac_per_layer"], whole[1][0]["dropped_frac_per_layer"])


@pytest.mark.slow
def test_aux_loss_metric_is_the_whole_batch():
    """With the Switch aux loss on, the first step's reported aux loss (E * sum f * P over the whole
    batch) and the whole batch's are the same."""
    sets = ["model.router=softmax", "model.bias_update=none", "model.aux_loss_coef=0.01", "model.dispatch=dropless"]
    (_, whole), (_, micro) = _train(sets, 0, steps=1), _train(sets, 2, steps=1)
    assert micro[0]["aux_loss"] == pytest.approx(whole[0]["aux_loss"], rel=1e-6)
    assert micro[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-6)


def test_micro_batch_config_errors():
    with pytest.raises(ConfigError, match=r"train\.micro_batch: 3 does not divide train\.batch_size=8"):
        load_config("tiny", ["train.batch_size=8", "train.micro_batch=3"])
    with pytest.raises(ConfigError, match=r"train\.micro_batch: 2 sequences do not split over .* 4 devices"):
        load_config("tiny", ["train.batch_size=8", "train.micro_batch=2", "mesh.data=4"])
    with pytest.raises(ConfigError, match=r"model\.capacity_group: 256 does not divide a micro-batch's 128 tokens"):
        load_config("tiny", ["train.batch_size=8", "train.micro_batch=1", "model.capacity_group=256"])
    r = run_cli("config", "tiny", "--set", "train.micro_batch=-1")
    assert r.returncode == 2 and "train.micro_batch: must be >= 0" in r.stderr
