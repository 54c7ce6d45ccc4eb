"""Host offload (``train.offload``): the optimizer state kept in pinned host memory and the
rematerialised blocks' inputs saved there give the same steps as without, and the programs really
place those buffers in host memory: the compiled HLO's entry layout (XLA:CPU keeps a memory space
for parameters and results), and, for the block inputs that XLA:CPU moves as no-ops, the saved
residuals' memory spaces and the program lowered for a CUDA GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO, random_batch, run_cli
from moelab.config import ConfigError, load_config
from moelab.model import loss_fn
from moelab.model import transformer as tr
from moelab.parallel import mesh as pmesh
from moelab.plan.memory import on_host, residuals
from moelab.plan.memory_check import host_buffers
from moelab.train import optim
from moelab.train.step import init_train_state, make_train_step, offload_state

SETS = MICRO + ["model.remat=layer", "model.n_layers=2", "model.sliding_window=0", "train.batch_size=8"]


_batch = random_batch


def _steps(offload, mesh_shape=None, n=2):
    cfg = load_config("tiny", SETS + [f"train.offload={offload}"])
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    shardings = None
    if mesh_shape:
        mesh = pmesh.auto_mesh(*mesh_shape)
        state = pmesh.shard_tree(state, mesh, fsdp=True)
    state = offload_state(state, cfg)
    if mesh_shape:
        shardings = jax.tree.map(lambda x: x.sharding, state)
    step = make_train_step(cfg, opt, h, shardings)
    losses = []
    b = _batch(cfg, 0)
    for s in range(n):
        b = _batch(cfg, s) if not mesh_shape else pmesh.put_batch(_batch(cfg, s), mesh)
        state, m = step(state, b, np.int32(s))
        losses.append(float(m["loss"]))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state["opt_state"])}
    return (jax.device_get(state) if n else None), losses, kinds, (step, state, b)


@pytest.mark.slow  # the compiled placement and the residuals' memory spaces are checked by default
@pytest.mark.parametrize("mesh_shape", [None, (2, 4)], ids=["one", "2x4"])
def test_offload_gives_the_same_steps(mesh_shape):
    ref, ref_losses, ref_kinds, _ = _steps("none", mesh_shape)
    got, losses, kinds, _ = _steps("all", mesh_shape)
    assert ref_kinds == {"device"} and kinds == {"pinned_host"}  # kept on the host between steps
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_compiled_program_keeps_optimizer_state_in_host_memory():
    """XLA's compiled entry layout: every optimizer-state parameter and result in host memory
    (S(5)), nothing else; without offload, nothing."""
    for offload in ("optimizer", "none"):
        _, _, _, (step, state, b) = _steps(offload, n=0)
        hlo = step.lower(state, b, np.int32(1)).compile().as_text()
        args, outs = host_buffers(hlo)
        want_state = [path[0].key == "opt_state" and offload != "none"
                      for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]  # fmt: skip
        assert args[: len(want_state)] == want_state and not any(args[len(want_state) :])
        assert outs[: len(want_state)] == want_state and not any(outs[len(want_state) :])


def test_block_inputs_are_saved_in_host_memory():
    """With remat: layer, the backward pass keeps each scanned block's input, and nothing else of
    the layers: in host memory under train.offload layer_inputs (the saved residuals' memory
    space), and the program JAX lowers for a CUDA GPU copies them out (annotate_device_placement to
    pinned_host); XLA:CPU compiles those moves as no-ops, so the CPU program cannot show it."""
    cfg = load_config("tiny", SETS)
    m = cfg.model
    params = init_train_state(cfg, optim.make_optimizer(cfg, optim.hyper(cfg)))["params"]
    state = tr.init_state(m)
    tokens = jnp.asarray(_batch(cfg, 0))
    block = (cfg.train.batch_size, m.seq_len, m.d_model)
    n_blocks = tr.scan_blocks(m)[1] // tr.scan_blocks(m)[0]

    def f(p, runtime=pmesh.ONE):
        return loss_fn(p, state, tokens[:, :-1], tokens[:, 1:], m, runtime=runtime)[0]

    offloading = pmesh.Runtime(offload_inputs=True)  # as the train step traces with train.offload layer_inputs

    def saved(offload):
        if offload:
            return residuals(lambda p: f(p, offloading), params)
        return residuals(f, params)

    def inputs(kept):
        return [aval for aval in kept if tuple(aval.shape) == (n_blocks,) + block]

    device, host = inputs(saved(False)), inputs(saved(True))
    assert len(device) == 1 and not on_host(device[0])
    assert len(host) == 1 and on_host(host[0])
    assert not any(on_host(a) for a in saved(True) if a not in host)  # nothing else moved
    text = jax.jit(jax.grad(lambda p: f(p, offloading))).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("annotate_device_placement") >= 2 and '_xla_buffer_placement = "pinned_host"' in text


def test_offload_config_errors():
    with pytest.raises(ConfigError, match=r"train\.offload: layer_inputs .* set model\.remat=layer"):
        load_config("tiny", ["train.offload=layer_inputs"])
    r = run_cli("config", "tiny", "--set", "train.offload=disk")
    assert r.returncode == 2 and "train.offload: must be one of" in r.stderr


@pytest.mark.parametrize("equal", [pytest.param(True, marks=pytest.mark.slow), False], ids=["same-grads", "kept"])
def test_each_layer_remat_computes_the_same_and_keeps_each_layers_input(equal):
    """remat each_layer (a period rematerialised, and within its recomputation every layer its own
    checkpoint) gives the loss and gradients of no remat; the backward pass keeps each period's input
    (on the host when offloading), nothing of a layer's inside."""
    cfg = load_config("tiny", MICRO + ["model.n_layers=4", "model.sliding_window=16", "model.global_every=2"])
    params = init_train_state(cfg, optim.make_optimizer(cfg, optim.hyper(cfg)))["params"]
    tokens = jnp.asarray(_batch(cfg, 1))

    def f(p, m, runtime=pmesh.ONE):
        return loss_fn(p, tr.init_state(m), tokens[:, :-1], tokens[:, 1:], m, runtime=runtime)[0]

    each = load_config(cfg, ["model.remat=each_layer"]).model
    if equal:
        ref = jax.value_and_grad(f)(params, cfg.model)
        got = jax.value_and_grad(f)(params, each)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        return
    shape = (cfg.train.batch_size, cfg.model.seq_len, cfg.model.d_model)
    period, n_full = tr.scan_blocks(each)
    kept = residuals(lambda p: f(p, each, pmesh.Runtime(offload_inputs=True)), params)
    host = [a for a in kept if on_host(a)]
    # each period's input, on the host (its layers' inputs live only while it is recomputed)
    assert len(host) == 1 and tuple(host[0].shape) == (n_full // period,) + shape
