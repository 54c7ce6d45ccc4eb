"""The device mesh and the one place that maps logical axes to mesh axes.

A mesh has two axes, ``data`` and ``expert`` (config ``mesh.data`` x ``mesh.expert`` = devices).
Routed-expert weights are sharded over ``expert``; everything else is replicated; the batch is
sharded over both axes, so each device holds ``batch / (data * expert)`` sequences.
"""

from __future__ import annotations

import os
import re
import sys

from moelab.errors import MeshError  # noqa: F401 - raised here, importable from here

BATCH = ("data", "expert")  # the mesh axes the batch (and every token-major array) is split over
EXPERT_PARAMS = ("w_gate", "w_up", "w_down")  # stacked [layers, experts, ...]: split over ``expert``

_ACTIVE = None  # the mesh the model's MoE blocks run their transports on (None: one device)


def request_devices(n: int) -> None:
    """Simulate ``n`` CPU devices; must run before JAX is imported (``moelab train --devices N``)."""
    if "jax" in sys.modules:
        import jax

        if jax.device_count() != n and jax.default_backend() == "cpu":
            raise MeshError(
                f"--devices: JAX is already running with {jax.device_count()} devices; cannot change to {n}"
            )
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def make_mesh(mesh_cfg, n_routed: int):
    """The ``(data, expert)`` mesh over all devices, checked against the config."""
    import jax

    n = jax.device_count()
    if mesh_cfg.data * mesh_cfg.expert != n:
        raise MeshError(
            f"mesh.data x mesh.expert = {mesh_cfg.data} x {mesh_cfg.expert} = {mesh_cfg.data * mesh_cfg.expert}, "
            f"but there are {n} devices; make the product {n} (or run with --devices "
            f"{mesh_cfg.data * mesh_cfg.expert})"
        )
    if n_routed % mesh_cfg.expert:
        raise MeshError(f"mesh.expert: {mesh_cfg.expert} does not divide model.n_routed={n_routed}")
    return auto_mesh(mesh_cfg.data, mesh_cfg.expert)


def auto_mesh(data: int, expert: int):
    """A (data, expert) mesh whose axes XLA shards automatically outside the transports."""
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((data, expert), ("data", "expert"), axis_types=(AxisType.Auto, AxisType.Auto))


def set_active(mesh) -> None:
    """Make the MoE blocks run expert-parallel on ``mesh`` (None: single-device dispatch)."""
    global _ACTIVE
    _ACTIVE = mesh


def active():
    """The active mesh when it has more than one device on its expert axis, else None."""
    if _ACTIVE is None or _ACTIVE.shape["expert"] == 1:
        return None
    return _ACTIVE


def spec_for(path: tuple[str, ...], ndim: int):
    """The PartitionSpec of one parameter (or optimiser-state) leaf, from its name."""
    from jax.sharding import PartitionSpec as P

    if path and path[-1] in EXPERT_PARAMS and ndim >= 2:
        return P(None, "expert")
    return P()


def shard_tree(tree, mesh):
    """Place every leaf of a params / train-state tree on ``mesh`` by its name."""
    import jax
    from jax.sharding import NamedSharding

    def place(path, leaf):
        if not hasattr(leaf, "ndim"):
            return leaf
        names = tuple(getattr(p, "key", getattr(p, "name", str(p))) for p in path)
        # optimiser state nests the params' names under its own; the last param name decides
        named = [n for n in names if isinstance(n, str)]
        spec = spec_for(tuple(named[-1:]), leaf.ndim) if named else spec_for((), leaf.ndim)
        if leaf.ndim == 0:
            spec = spec_for((), 0)
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, tree)


def batch_sharding(mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P(BATCH))


def put_batch(batch, mesh):
    """A host batch (the same on every process) as one global array split over ``BATCH``."""
    import jax

    sharding = batch_sharding(mesh)
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])
