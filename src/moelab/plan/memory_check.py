"""The memory plan (``moelab.plan.memory``) against the compiler: the train step compiled ahead of
time for a simulated mesh on abstract inputs, XLA's per-device memory analysis beside the plan.

XLA:CPU does not keep every rematerialisation a GPU compiler would: the recomputation of layers
that run unrolled (fewer than two whole periods of the local/global pattern: ``scan_blocks``)
depends only on forward values, and XLA:CPU schedules it early, which keeps every activation
alive. For such a config the check says so, compares the plan without remat against XLA without
remat, and checks the policy itself in the compiled program: the rematerialised step recomputes
the forward matmuls in its backward pass (more dot operations than without remat).
"""

from __future__ import annotations

import re

from moelab import devices
from moelab.config import Config, load_config
from moelab.errors import UsageError
from moelab.parallel import mesh as pmesh
from moelab.plan.memory import (
    UPDATE_ONLY,
    abstract_state,
    counted_bytes,
    for_target,
    global_dispatch,
    plan,
    remat_blocks,
)
from moelab.progress import say
from moelab.train import optim
from moelab.train.step import make_train_step

HOST_SPACE = "S(5)"  # XLA's memory space of host memory in a layout (pinned_host)


def compiled_bytes(cfg: Config, data: int, expert: int, micro_batch: int, fsdp: bool) -> dict:
    """XLA's per-device memory analysis of ``cfg``'s train step, compiled ahead of time for a
    ``data`` x ``expert`` mesh of this process's devices on abstract inputs (nothing is allocated)."""
    import jax
    import numpy as np

    n_dev = data * expert
    if jax.device_count() < n_dev:
        raise UsageError(
            f"--check: the mesh needs {n_dev} devices and JAX has {jax.device_count()}; "
            f"on CPU run with XLA_FLAGS=--xla_force_host_platform_device_count={n_dev}"
        )
    mesh = pmesh.auto_mesh(data, expert, jax.devices()[:n_dev])
    opt, state = abstract_state(cfg)
    shardings = pmesh.tree_shardings(state, mesh, fsdp)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
    m = cfg.model
    batch = jax.ShapeDtypeStruct((micro_batch * n_dev, m.seq_len + 1), np.int32, sharding=pmesh.batch_sharding(mesh))
    step = make_train_step(cfg, opt, optim.hyper(cfg), shardings, mesh=mesh, fsdp=fsdp)
    compiled = step.lower(abstract, batch, np.int32(0)).compile()
    mem = compiled.memory_analysis()
    out = {
        "arguments": int(mem.argument_size_in_bytes),
        "outputs": int(mem.output_size_in_bytes),
        "aliased": int(mem.alias_size_in_bytes),
        "temporaries": int(mem.temp_size_in_bytes),
        "matmuls": matmuls(compiled.as_text()),
    }
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


def matmuls(hlo_text: str) -> int:
    """The dot operations of a compiled program (a rematerialised step runs its forward matmuls again)."""
    return len(re.findall(r"= [^=\n]*? dot\(", hlo_text))


def check_layers(cfg: Config) -> tuple[int, int]:
    """The depths compiled by the check: 1 and 2 layers, or two and three rematerialised blocks
    when ``remat: layer`` scans blocks (fewer layers would be rematerialised one by one, which
    XLA:CPU schedules away)."""
    if cfg.model.remat != "none":
        period, n_full, _ = remat_blocks(cfg.model)
        if n_full:
            return 2 * period, 3 * period
    return 1, 2


def compiler_check(
    cfg: Config, data: int, expert: int, *, micro_batch: int | None = None, fsdp: bool | None = None,
    layers: tuple[int, int] | None = None, progress: bool = False, device: str | None = None,
) -> dict:  # fmt: skip
    """The plan against the compiler: the train step of copies of ``cfg`` with ``layers`` layers
    (full width) compiled for the mesh, XLA's per-device totals extended linearly to the config's
    depth, beside the plan's total without its margin. ``ratio`` = plan / compiler; for layers
    rematerialised unrolled (see the module's docstring) both without remat, the configured figures
    and the recomputed matmuls in ``remat_unrolled``.

    Both sides are taken in fp32: XLA:CPU computes bf16 through fp32 buffers, so a bf16 step
    compiled here would not show the memory a GPU or TPU gives it."""
    # long (95 lines): the check's steps in order (compile two depths, extend, compare, read the policy), sharing their figures

    n_dev = data * expert
    fsdp = cfg.mesh.fsdp if fsdp is None else fsdp
    dev = devices.lookup(device) if device else None
    target, attention = for_target(cfg, dev)
    dtype = target.model.dtype
    cfg = load_config(target, ["model.compute_dtype=float32"])
    layers = layers or check_layers(cfg)
    full = plan(cfg, data, expert, micro_batch=micro_batch, fsdp=fsdp, max_micro_batch=False)
    b, n_micro = full["micro_batch"], full["micro_batches"]

    def side(c: Config, what: str) -> tuple[dict, float, int]:
        """(XLA's figures per depth compiled, XLA's total scaled to the config's depth, the plan's total)."""
        got = {}
        for n in layers:
            say(f"compiling the train step{what} with {n} layer(s) for a {data} x {expert} mesh (abstract inputs)",
                progress)  # fmt: skip
            small = load_config(c, [f"model.n_layers={n}", f"train.batch_size={b * n_micro * n_dev}",
                                    f"train.micro_batch={b * n_dev if n_micro > 1 else 0}"])  # fmt: skip
            got[n] = compiled_bytes(small, data, expert, b * n_micro, fsdp)
        (n1, n2), depth = layers, c.model.n_layers
        t1, t2 = got[n1]["total"], got[n2]["total"]
        p = plan(c, data, expert, micro_batch=b, fsdp=fsdp, max_micro_batch=False) if c is not cfg else full
        # XLA:CPU has one memory: offloaded buffers are its arguments and temporaries like any other, and
        # the moves between memories compile to nothing; so the plan's device and host rows are compared
        # together, without the optimizer state moved in for the update
        return (
            got,
            t1 + (t2 - t1) * (depth - n1) / (n2 - n1),
            counted_bytes({**p["rows"], UPDATE_ONLY: 0}) + p["host_total"],
        )

    compiled, scaled, together = side(cfg, "")
    ratio = together / scaled
    unconfirmed, remat = [], None
    if cfg.model.remat != "none" and not remat_blocks(cfg.model)[1]:
        # the layers run unrolled: XLA:CPU schedules their recomputation early and keeps every activation,
        # where a GPU's scheduler frees them; compared without remat, the policy checked in the program
        plain, scaled_plain, together_plain = side(load_config(cfg, ["model.remat=none"]), " without remat")
        n1 = layers[0]
        remat = {
            "kept_by_xla_cpu": False,
            "plan_saving": 1 - together / together_plain,
            "compiler_saving": 1 - scaled / scaled_plain,
            "recomputed_matmuls": compiled[n1]["matmuls"] - plain[n1]["matmuls"],
            "plan_total_without": together_plain,
            "compiler_total_without": int(scaled_plain),
            "ratio_as_configured": ratio,
        }
        ratio = together_plain / scaled_plain
        unconfirmed.append(
            f"remat {cfg.model.remat}: these {cfg.model.n_layers} layers run unrolled (fewer than two whole periods "
            f"of the local/global pattern) and XLA:CPU schedules their recomputation early, keeping every "
            f"activation: its total drops {remat['compiler_saving']:.0%} where the plan's drops "
            f"{remat['plan_saving']:.0%} (plan {together / 1e9:.3f} GB, XLA {scaled / 1e9:.3f} GB as configured). "
            f"Compared without remat: plan {together_plain / 1e9:.3f} GB, XLA {scaled_plain / 1e9:.3f} GB; the "
            f"policy itself, in the compiled program: {remat['recomputed_matmuls']} matmuls recomputed at "
            f"{n1} layer(s)"
        )
        scaled, together = scaled_plain, together_plain
    if dtype != "float32":
        unconfirmed.append(f"{dtype}: XLA:CPU computes it through fp32 buffers, so both sides are taken in fp32")
    if full["host_total"]:
        unconfirmed.append("device and host apart (train.offload): XLA:CPU has one memory, so their sum is compared; "
                           "the placement itself is read from the compiled HLO (tests/test_offload.py)")  # fmt: skip
        if full["rows"].get(UPDATE_ONLY):
            unconfirmed.append("the optimizer state moved in for the update: no copy is made on CPU")
    if attention.startswith("fused"):
        unconfirmed.append("the fused cuDNN attention: cuDNN cannot compile on CPU; moelab's flash path, which keeps "
                           "the same tensors, is compiled in its place")  # fmt: skip
    return {
        "compute_dtype": "float32" + ("" if dtype == "float32" else f" (the config's {dtype}: see above)"),
        "layers_compiled": list(layers),
        "compiled": {str(n): v for n, v in compiled.items()},
        "compiler_total": int(scaled),
        "plan_total": together,
        "ratio": ratio,
        "within_15pct": abs(ratio - 1) <= 0.15 and (remat is None or remat["recomputed_matmuls"] > 0),
        "remat_unrolled": remat,
        "global_dispatch": global_dispatch(cfg, n_dev, expert, b),
        "unconfirmed": unconfirmed,
    }


def _top_level(text: str) -> list[str]:
    """``text`` split at the commas outside any brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def host_buffers(hlo_text: str) -> tuple[list[bool], list[bool]]:
    """Which parameters and results of a compiled program XLA keeps in host memory, read from the
    memory space of each entry of the HLO module's ``entry_computation_layout`` (flattened in JAX's
    argument and output order)."""
    key = "entry_computation_layout={"
    start = hlo_text.index(key) + len(key)
    depth, end = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
        end += 1
    layout = hlo_text[start : end - 1]
    args, outs = layout.split(")->", 1)

    def flags(part: str) -> list[bool]:
        part = part.strip()
        if part.startswith("("):
            part = part[1:]
        if part.endswith(")"):
            part = part[:-1]
        return [HOST_SPACE in p for p in _top_level(part)]

    return flags(args), flags(outs)
