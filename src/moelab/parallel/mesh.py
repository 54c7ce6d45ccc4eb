"""The device mesh and the one place that maps logical axes to mesh axes.

A mesh has two axes, ``data`` and ``expert`` (config ``mesh.data`` x ``mesh.expert`` = devices).
Every parameter dimension has a logical name (``LOGICAL``); one table (``RULES``) maps names to
mesh axes. With ``mesh.fsdp`` (the default) parameters, their gradients and their optimiser state
are sharded over ``data`` (ZeRO-3: each layer's weights are gathered where they are used, and
their gradients reduce-scattered back), routed experts also over ``expert``; without it
(``RULES_REPLICATED``) only the experts are split, over ``expert``, and everything else is
replicated. The batch is sharded over both axes, so each device holds ``batch / (data * expert)``
sequences. A dimension that its mesh axis does not divide stays whole (``spec_for``).
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass

from moelab.errors import MeshError  # noqa: F401 - raised here, importable from here

BATCH = ("data", "expert")  # the mesh axes the batch (and every token-major array) is split over
MAX_SIMULATED_DEVICES = 1024  # more simulated CPU devices than this and XLA takes minutes to start, or hangs
EXPERT_PARAMS = ("w_gate", "w_up", "w_down")  # stacked [layers, experts, ...]: split over ``expert``

# each parameter's (and the router-bias state's) dimensions by logical name; layer weights are
# stacked on a leading "layers" axis (a per-layer slice drops it)
LOGICAL: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "head": ("embed", "vocab"),
    "final_norm": ("norm",),
    "attn_norm": ("layers", "norm"),
    "mlp_norm": ("layers", "norm"),
    "latent_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "q_heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "wo": ("layers", "q_heads", "embed"),
    "router": ("layers", "embed", "router_out"),
    "w_gate": ("layers", "experts", "expert_in", "expert_mlp"),
    "w_up": ("layers", "experts", "expert_in", "expert_mlp"),
    "w_down": ("layers", "experts", "expert_mlp", "expert_in"),
    "latent_down": ("layers", "embed", "latent"),
    "latent_up": ("layers", "latent", "embed"),
    "shared_gate": ("layers", "embed", "shared_mlp"),
    "shared_up": ("layers", "embed", "shared_mlp"),
    "shared_down": ("layers", "shared_mlp", "embed"),
    "router_bias": ("layers", "router_out"),
}

# logical name -> the mesh axes to shard it over, in order of preference: the first that divides the
# dimension (and that no earlier dimension of the leaf took) wins. A name not in the table is
# replicated. FSDP shards the other weights over every device where the dimension allows (both
# axes), else over `data`, else over `expert` (one EP group, replicated across the others: no
# JAX sharding may leave a remainder); experts over `expert` and their hidden dimension over
# `data`. Norms, the router's output (every token scores every expert) and the router bias stay
# whole: they are small.
RULES: dict[str, tuple[tuple[str, ...], ...]] = {
    "experts": (("expert",),),
    "embed": (("data", "expert"), ("data",), ("expert",)),
    "expert_mlp": (("data",),),
    "expert_in": (("data",),),
}
RULES_REPLICATED: dict[str, tuple[tuple[str, ...], ...]] = {"experts": (("expert",),)}  # mesh.fsdp: false


@dataclass(frozen=True)
class Runtime:
    """How the model's program is traced, passed in where it is traced (never a module's state).

    ``mesh``: the (data, expert) mesh the model runs on (None: one device): MoE blocks use the
    expert-parallel transports when its ``expert`` axis has several devices, and row-wise ops stay
    on each device's rows (``per_device``). ``fsdp``: each layer's weights are gathered over ``data``
    where used (``gathered``). ``whole_batch``: a micro-step of gradient accumulation, whose MoE blocks
    leave their bias unchanged and report what the whole batch's bias update and aux loss need.
    ``offload_inputs``: ``remat`` keeps each block's input in host memory (train.offload)."""

    mesh: object = None
    fsdp: bool = False
    whole_batch: bool = False
    offload_inputs: bool = False

    @property
    def expert_mesh(self):
        """The mesh when it has more than one device on its expert axis (the transports run on it), else None."""
        if self.mesh is None or self.mesh.shape["expert"] == 1:
            return None
        return self.mesh

    @property
    def shards(self) -> int:
        """How many devices a batch is split over (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.size

    def on(self, mesh, fsdp: bool = False) -> Runtime:
        """This runtime on ``mesh`` (FSDP only with a mesh)."""
        return Runtime(mesh, bool(fsdp and mesh is not None), self.whole_batch, self.offload_inputs)


ONE = Runtime()  # one device, no micro-steps, nothing offloaded


def rules(fsdp: bool) -> dict[str, tuple[tuple[str, ...], ...]]:
    return RULES if fsdp else RULES_REPLICATED


def axes_for(name: str, shape: tuple[int, ...], sizes: dict[str, int], fsdp: bool) -> tuple:
    """The mesh axes of each dimension of leaf ``name`` with ``shape`` on a mesh of axis ``sizes``:
    None (whole), one axis name, or a tuple of axes (split over their product).

    A name not in ``LOGICAL``, or a leaf whose rank is not its logical rank (nor one less: a
    per-layer slice), is replicated; a dimension none of its candidates divides stays whole."""
    names = LOGICAL.get(name)
    if names is None or len(shape) not in (len(names), len(names) - 1):
        return (None,) * len(shape)
    if len(shape) == len(names) - 1:
        names = names[1:]  # one layer's slice of a stacked weight
    table, used, out = rules(fsdp), set(), []
    for dim, logical in zip(shape, names, strict=True):
        choice = None
        for axes in table.get(logical, ()):
            n = math.prod(sizes.get(a, 1) for a in axes)
            if n > 1 and not used & set(axes) and dim % n == 0:
                choice = axes[0] if len(axes) == 1 else axes
                used.update(axes)
                break
        out.append(choice)
    return tuple(out)


def shards_of(axes: tuple, sizes: dict[str, int]) -> int:
    """How many pieces a leaf with these dimension axes is cut into (its bytes per device: size / this)."""
    flat = [a for x in axes if x is not None for a in ((x,) if isinstance(x, str) else x)]
    return math.prod(sizes[a] for a in flat)


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


def auto_mesh(data: int, expert: int, devices=None):
    """A (data, expert) mesh (of all devices, or ``devices``) whose axes XLA shards automatically
    outside the transports."""
    import jax
    from jax.sharding import AxisType

    kw = {} if devices is None else {"devices": devices}
    return jax.make_mesh((data, expert), ("data", "expert"), axis_types=(AxisType.Auto, AxisType.Auto), **kw)


def per_device(runtime: Runtime, fn, *xs):
    """``fn`` on each device's rows of token-major arrays (split over ``BATCH``) on ``runtime``'s
    mesh; a plain call without one. XLA's partitioner would gather some row-wise ops whole first
    (its TopK among them): this keeps them local."""
    if runtime.mesh is None or runtime.mesh.size == 1:
        return fn(*xs)
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.shard_map(fn, mesh=runtime.mesh, in_specs=tuple(P(BATCH) for _ in xs), out_specs=P(BATCH))(*xs)


def _leaf_name(path) -> str:
    """A leaf's name: the last string key on its path (optimiser state nests the params' names)."""
    named = [k for k in (getattr(p, "key", getattr(p, "name", None)) for p in path) if isinstance(k, str)]
    return named[-1] if named else ""


def spec_for(name: str, shape: tuple[int, ...], sizes: dict[str, int], fsdp: bool):
    """The PartitionSpec of one parameter (or optimiser-state) leaf, from its name and shape."""
    from jax.sharding import PartitionSpec as P

    return P(*axes_for(name, tuple(shape), sizes, fsdp))


def tree_shardings(tree, mesh, fsdp: bool):
    """The NamedSharding of every array leaf of a params / train-state tree (shapes are enough)."""
    import jax
    from jax.sharding import NamedSharding

    sizes = dict(mesh.shape)

    def one(path, leaf):
        return NamedSharding(mesh, spec_for(_leaf_name(path), tuple(leaf.shape), sizes, fsdp))

    return jax.tree_util.tree_map_with_path(one, tree)


def shard_tree(tree, mesh, fsdp: bool = False):
    """Place every leaf of a params / train-state tree on ``mesh`` by its name (``RULES``)."""
    import jax

    return jax.device_put(tree, tree_shardings(tree, mesh, fsdp))


def gathered(tree, runtime: Runtime):
    """Inside the model: a layer's weights (or the embeddings) gathered over ``data`` for use,
    experts still split over ``expert``: the ZeRO-3 all-gather, whose transpose in the backward
    pass is the gradients' reduce-scatter. Nothing unless ``runtime`` is FSDP on a mesh."""
    if not runtime.fsdp:
        return tree
    import jax
    from jax.sharding import NamedSharding

    mesh = runtime.mesh
    sizes = dict(mesh.shape)

    def one(path, leaf):  # the compute placement: experts split over `expert`, everything else whole
        spec = spec_for(_leaf_name(path), tuple(leaf.shape), sizes, False)
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P(BATCH))


def put_batch(batch, mesh):
    """A host batch (the same on every process) as one global array split over ``BATCH``."""
    import jax

    sharding = batch_sharding(mesh)
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def local_rows(shape: tuple[int, ...], mesh) -> tuple[int, int]:
    """The rows [lo, hi) of a batch of ``shape`` split over ``BATCH`` that this process's devices hold."""
    spans = [
        (idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
        for idx in batch_sharding(mesh).addressable_devices_indices_map(shape).values()
    ]
    return min(a for a, _ in spans), max(b for _, b in spans)


def put_rows(build, shape: tuple[int, ...], mesh):
    """A global batch of ``shape`` split over ``BATCH`` in which each process builds only the rows
    its own devices hold: ``build(lo, hi)`` gives rows lo..hi (the same rows any process would)."""
    import jax

    lo, hi = local_rows(shape, mesh)
    block = build(lo, hi)

    def rows(index):
        a = index[0].start or 0
        b = shape[0] if index[0].stop is None else index[0].stop
        return block[a - lo : b - lo]

    return jax.make_array_from_callback(shape, batch_sharding(mesh), rows)
