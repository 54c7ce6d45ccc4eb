"""The jitted train step (donated state) and the evaluation step.

A step whose loss or gradients are not finite changes nothing: parameters, optimiser state and
router biases stay as they were, and ``finite`` is False in its metrics.

Gradient accumulation (``train.micro_batch``): the batch is cut into ``batch_size / micro_batch``
micro-batches, each device keeping its own rows (micro-batch i takes the i-th slice of every
device's rows, so nothing moves between devices); a ``lax.scan`` runs them one after another and
sums their gradients, then one update follows. What the step reports is the whole batch's: the
cross-entropy, z-losses, router entropy and drop shares are means over equal micro-batches; the
expert loads are summed; the aux loss metric is E * sum f * P from the batch-wide f and P; the
router bias is updated once, from the whole batch (the quantile update from every micro-batch's
margins together, the sign update from the summed loads). Capacity groups are formed within a
micro-batch (``capacity_group: 0`` is a device's tokens of the micro-batch), so where the groups
are the same (dropless, or a group of one sequence) the step equals the whole batch's up to
float rounding. The aux loss's gradient (when ``aux_loss_coef`` > 0) is each micro-batch's own, as
Megatron computes it: its f is the micro-batch's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moelab.config import Config
from moelab.model import init_params, init_state, loss_fn
from moelab.model import router as rt
from moelab.model.layers import document_segments
from moelab.model.transformer import ce_terms, forward, total_loss
from moelab.parallel import mesh as pmesh
from moelab.train import optim


def init_train_state(cfg: Config, opt: optax.GradientTransformation) -> dict:
    params = init_params(cfg.model, jax.random.PRNGKey(cfg.train.seed))
    return {"params": params, "opt_state": opt.init(params), "model_state": init_state(cfg.model)}


def _layer_summary(layers: dict) -> dict:
    """Per-layer lists and their means for the metrics line."""
    out = {}
    for key in ("dropped_frac", "spilled_frac", "max_mean_load", "router_entropy", "router_z", "bias_mean", "bias_std"):
        out[key] = jnp.mean(layers[key])
        out[f"{key}_per_layer"] = layers[key]
    out["expert_load"] = layers["expert_load"]
    return out


def micro_batches(batch: jax.Array, n: int, shards: int = 1) -> jax.Array:
    """[B, s] -> [n, B / n, s]: micro-batch i holds the i-th slice of each device's rows (the batch
    is split over ``shards`` devices in contiguous blocks), so no row changes device."""
    d = shards
    rows, width = batch.shape
    return batch.reshape(d, n, rows // (d * n), width).swapaxes(0, 1).reshape(n, rows // n, width)


SUMMED = ("expert_load", "tokens_per_expert")  # per-layer metrics that add over micro-batches; the rest average


def _whole_batch(per_micro: dict, bias: jax.Array, m, runtime: pmesh.Runtime) -> tuple[dict, jax.Array]:
    """The layers' metrics of the whole batch and its new router bias, from the micro-steps' [n, L, ...]."""
    layers = {}
    for key, v in per_micro.items():
        if key in ("bias_stat", "aux_terms"):
            continue
        layers[key] = jnp.sum(v, axis=0) if key in SUMMED else jnp.mean(v, axis=0)
    load = layers["expert_load"]
    layers["max_mean_load"] = jnp.max(load, axis=-1) / jnp.mean(load, axis=-1)
    f, p = jnp.mean(per_micro["aux_terms"], axis=0).swapaxes(0, 1)  # [L, 2, E] -> f, P [L, E]
    layers["aux_loss"] = m.n_routed * jnp.sum(f * p, axis=-1)
    stat = per_micro["bias_stat"]  # [n, L, ...]
    if m.bias_update == "quantile":  # every micro-batch's margins together: [L, n * t, E]
        stat = stat.swapaxes(0, 1).reshape(stat.shape[1], -1, stat.shape[-1])
    else:
        stat = jnp.sum(stat, axis=0)
    new_bias = jax.lax.map(lambda a: rt.bias_from_stat(a[0], a[1], m, runtime), (stat, bias))
    return layers, new_bias


def offload_state(state: dict, cfg: Config) -> dict:
    """The train state with its optimizer state in pinned host memory when ``train.offload`` says
    so (each leaf keeps its devices and sharding; only the memory kind changes), else as it was."""
    if cfg.train.offload not in ("optimizer", "all"):
        return state
    host = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), state["opt_state"])
    return dict(state, opt_state=host)


def split_masked(batch: jax.Array, masked: bool, eot: int | None = None):
    """(inputs, targets, loss mask or None, segments or None) of a batch [rows, length + 1]; with
    ``masked``, the tokens given as ``-id - 1`` read as ``id`` and left out of the loss as targets, and
    with ``eot`` the packed documents' segments (each attends only within itself)."""
    if not masked:
        return batch[:, :-1], batch[:, 1:], None, None
    ids = jnp.where(batch < 0, -batch - 1, batch)
    inputs = ids[:, :-1]
    return inputs, ids[:, 1:], batch[:, 1:] >= 0, None if eot is None else document_segments(inputs, eot)


def make_train_step(
    cfg: Config,
    opt: optax.GradientTransformation,
    h: optim.Hyper,
    shardings=None,
    *,
    mesh=None,
    fsdp: bool | None = None,
    faults: bool = False,
    masked: bool = False,
    eot: int | None = None,
):
    """The jitted train step ``(state, batch, data_step) -> (state, metrics)``.

    ``masked``: the batches come from a store of conversations (moelab.data.mixture.batch_rows): a
    token that does not count in the loss is given as ``-id - 1``; the model reads ``id``, and the loss
    averages over the targets that count (``split_masked``); with ``eot`` (the store's end of text),
    the documents packed in a row attend each only within itself.

    ``shardings``: the state's NamedShardings on a mesh (``parallel.mesh.tree_shardings``): the
    gradients are held to the parameters' (so XLA reduce-scatters them over ``data`` under FSDP
    rather than all-reducing whole copies) and the new state to the old state's. ``mesh``: the mesh
    the model runs on (the shardings' when not given); ``fsdp``: whether its weights are gathered over
    ``data`` where used (``mesh.fsdp`` when not given).

    ``faults``: the step of a run that injects faults (``monitor.faults.Injector.wrap_step`` gives it
    its arguments): ``(state, batch, data_step, faults)`` with ``faults`` a dict of ``poison`` (the
    loss made NaN), ``lr_scale``, ``logit_z_scale`` and ``freeze_bias``. A production step is
    compiled without them."""
    # long (124 lines): the jitted step and its accumulation are closures over the config's constants, shardings and runtime, defined where they are traced
    m = cfg.model
    hold = (lambda tree, s: jax.lax.with_sharding_constraint(tree, s)) if shardings is not None else (lambda t, s: t)  # noqa: E731

    n_micro = cfg.train.batch_size // cfg.train.micro_batch if cfg.train.micro_batch else 1
    off_opt = cfg.train.offload in ("optimizer", "all")
    off_inputs = cfg.train.offload in ("layer_inputs", "all")
    if mesh is None and shardings is not None:
        mesh = jax.tree.leaves(shardings)[0].mesh
    fsdp = cfg.mesh.fsdp if fsdp is None else fsdp
    runtime = pmesh.Runtime(mesh, bool(fsdp and mesh is not None), offload_inputs=off_inputs)
    micro_runtime = dataclasses.replace(runtime, whole_batch=True)  # a micro-step: the whole batch's statistics
    host_opt = shardings and shardings["opt_state"]
    if shardings is not None:  # the step computes in device memory whatever memory the state is kept in
        shardings = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)
    grad_shardings = shardings and shardings["params"]
    moved = lambda tree, s, space: jax.device_put(tree, s if s is not None else space)  # noqa: E731

    def accumulate(state: dict, batch: jax.Array, logit_z_scale):
        """The micro-steps: (loss, metrics, new model state, mean gradients) of the whole batch."""
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def micro(acc, mb):
            inputs, targets, mask, segments = split_masked(mb, masked, eot)
            (_, (met, _)), g = grad_fn(
                state["params"], state["model_state"], inputs, targets, m, mask=mask, segments=segments,
                logit_z_scale=logit_z_scale, runtime=micro_runtime,
            )  # fmt: skip
            acc = hold(jax.tree.map(jnp.add, acc, hold(g, grad_shardings)), grad_shardings)
            if (
                runtime.expert_mesh is not None and m.bias_update == "quantile"
            ):  # the margins stay split by token, as the
                # batch is (left to itself XLA replicates the stacked scan output on every device)
                margins = jax.lax.with_sharding_constraint(
                    met["layers"]["bias_stat"], NamedSharding(runtime.mesh, P(None, pmesh.BATCH, None))
                )
                met = dict(met, layers=dict(met["layers"], bias_stat=margins))
            return acc, {k: met[k] for k in ("ce", "logit_z", "router_z", "layers")}

        zeros = hold(jax.tree.map(jnp.zeros_like, state["params"]), grad_shardings)
        acc, per = jax.lax.scan(micro, zeros, micro_batches(batch, n_micro, runtime.shards))
        grads = jax.tree.map(lambda g: g / n_micro, acc)
        layers, new_bias = _whole_batch(per["layers"], state["model_state"]["router_bias"], m, runtime)
        ce, logit_z, router_z = (jnp.mean(per[k]) for k in ("ce", "logit_z", "router_z"))
        aux = jnp.mean(layers["aux_loss"])
        loss = total_loss(ce, logit_z, aux, router_z, m, logit_z_scale)
        metrics = {"ce": ce, "logit_z": logit_z, "aux_loss": aux, "router_z": router_z, "layers": layers}
        return loss, metrics, {"router_bias": new_bias}, grads

    def step(state: dict, batch: jax.Array, data_step: jax.Array, faults=None):
        f = faults or {"lr_scale": 1.0, "logit_z_scale": 1.0, "freeze_bias": False, "poison": False}
        if off_opt:  # kept in host memory between steps: moved in for the update
            state = dict(state, opt_state=moved(state["opt_state"], shardings and shardings["opt_state"],
                                                jax.memory.Space.Device))  # fmt: skip
        opt_state, _ = optim.set_lr(state["opt_state"], data_step, h, f["lr_scale"])
        lr = optim.applied_rate(opt_state)  # what the optimiser will apply, read from its state
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if n_micro == 1:
            inputs, targets, mask, segments = split_masked(batch, masked, eot)
            (loss, (metrics, new_model_state)), grads = grad_fn(
                state["params"], state["model_state"], inputs, targets, m, mask=mask, segments=segments,
                logit_z_scale=f["logit_z_scale"], runtime=runtime,
            )  # fmt: skip
        else:
            loss, metrics, new_model_state, grads = accumulate(state, batch, f["logit_z_scale"])
        if faults is not None:
            new_model_state = jax.tree.map(
                lambda new, old: jnp.where(f["freeze_bias"], old, new), new_model_state, state["model_state"]
            )
        grads = hold(grads, grad_shardings)
        if faults is not None:
            loss = jnp.where(f["poison"], jnp.nan, loss)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def update(_):
            updates, new_opt_state = opt.update(grads, opt_state, state["params"])
            return {"params": optax.apply_updates(state["params"], updates), "opt_state": new_opt_state,
                    "model_state": new_model_state}  # fmt: skip

        # a branch, not a select over every leaf: the select was a pass over the whole state (3% of
        # a CPU step at shape A)
        new_state = jax.lax.cond(finite, update, lambda _: state, None)
        new_state = hold(new_state, shardings)
        if off_opt:  # and out again
            new_state = dict(new_state, opt_state=moved(new_state["opt_state"], host_opt, jax.memory.Space.Host))
        out = {
            "loss": loss,
            "ce": metrics["ce"],
            "logit_z": metrics["logit_z"],
            "aux_loss": metrics["aux_loss"],
            "router_z_loss": metrics["router_z"],
            "lr": lr,
            "grad_norm": grad_norm,
            "grad_norm_groups": optim.group_norms(grads),
            "param_norm_groups": optim.group_norms(new_state["params"]),
            "finite": finite,
            **_layer_summary(metrics["layers"]),
        }
        return new_state, out

    if faults:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(lambda state, batch, data_step: step(state, batch, data_step), donate_argnums=0)


def make_eval_step(cfg: Config, mesh=None, eot: int | None = None):
    """(params, model_state, inputs, targets, mask) -> summed nats and token count, per dispatch; on
    ``mesh`` as the model trains there (the expert-parallel transports, FSDP gathers). ``eot``: packed
    documents attend each only within itself (a store of conversations, as its step trains)."""
    m = cfg.model
    runtime = pmesh.Runtime(mesh, bool(cfg.mesh.fsdp and mesh is not None))

    def nll(params, model_state, inputs, targets, mask, dispatch):
        segments = None if eot is None else document_segments(inputs, eot)
        hidden, _, _ = forward(params, model_state, inputs, m, dispatch, runtime=runtime, segments=segments)
        lse, tgt = ce_terms(params, hidden, targets, m.ce_chunk, runtime)
        return jnp.sum((lse - tgt) * mask), jnp.sum(mask)

    return jax.jit(nll, static_argnames="dispatch")
