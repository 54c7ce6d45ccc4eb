"""The MoE block: shared experts, an optional latent path, and routed experts under three dispatches.

- dropless: sort assignments by expert and run grouped matmuls (``jax.lax.ragged_dot``, or
  expert-pure blocks of rows on CPU, where ragged_dot is slow);
- capacity: ``ceil(CF * T * k / E)`` slots per expert per group, overflow dropped by position
  or by lowest router score;
- spill: as capacity, then each overflowing assignment walks its token's next-ranked experts
  until one has room.
Shapes are static and no Python loop runs over experts or tokens.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig
from moelab.model import router as rt
from moelab.model.layers import rms_norm, swiglu
from moelab.parallel import ep
from moelab.parallel import mesh as pmesh


def expert_ffn(w: dict, buf: jax.Array) -> jax.Array:
    """Every expert's SwiGLU on its own slots. buf: [e, c, din] -> [e, c, din].

    The one expert computation: capacity, spill and the expert-parallel transports all call it.
    """
    gate = jnp.einsum("ecd,edf->ecf", buf, w["w_gate"])
    up = jnp.einsum("ecd,edf->ecf", buf, w["w_up"])
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w["w_down"])


def dropless_ragged(h: jax.Array, idx: jax.Array, gates: jax.Array, w: dict) -> jax.Array:
    """Every assignment computed: sort by expert, ``ragged_dot`` grouped matmuls, unsort, weight.

    The reference dropless path, and the fast one where XLA has grouped-matmul kernels (GPU, TPU).
    h: [t, din], idx and gates: [t, k].
    """
    t, k = idx.shape
    n_experts = w["w_gate"].shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment ids grouped by expert
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    xs = h[order // k]
    hidden = jax.nn.silu(jax.lax.ragged_dot(xs, w["w_gate"], sizes)) * jax.lax.ragged_dot(xs, w["w_up"], sizes)
    out_sorted = jax.lax.ragged_dot(hidden, w["w_down"], sizes)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
    out = out_sorted[inverse].reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", out, gates.astype(out.dtype))


def block_size(n_assignments: int, n_experts: int) -> int:
    """Rows per block of ``dropless_blocks``: about half of an expert's fair share, a multiple of 8.
    (The loop, ``dropless_loop``, covers each expert with blocks of four sizes instead: ``cover_plan``.)

    Padding each expert to whole blocks adds at most half to the work (a quarter on average), and
    XLA:CPU runs matmuls of 256 rows about 1.7x as fast as 128. Measured side by side against a
    quarter share (with the state update as a branch): train step 1.05x at shape A, 1.12x at B.
    """
    return max(8, -(-n_assignments // (2 * n_experts) // 8) * 8)


class BlockPlan(NamedTuple):
    """Assignments sorted by expert, each expert's rows padded to whole blocks of one expert."""

    row: jax.Array  # [t*k] each assignment's row in the padded layout
    src: jax.Array  # [n_blocks, bsz] the token that fills each row (t = the zero row for padding)
    block_expert: jax.Array  # [n_blocks] the expert of each block
    n_used: jax.Array  # [] blocks that hold any assignment (the rest are all padding)


def block_plan(idx: jax.Array, n_experts: int, bsz: int) -> BlockPlan:
    """The blocked layout of ``idx`` [t, k]. The number of blocks has a static bound: t*k/bsz + E."""
    t, k = idx.shape
    n = t * k
    n_blocks = -(-n // bsz) + n_experts
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts)
    starts = jnp.cumsum(sizes) - sizes
    padded = -(-sizes // bsz) * bsz
    padded_starts = jnp.cumsum(padded) - padded
    expert_sorted = flat[order]
    row_sorted = padded_starts[expert_sorted] + jnp.arange(n) - starts[expert_sorted]
    row = jnp.zeros_like(row_sorted).at[order].set(row_sorted)
    # which token fills each row; a scatter of ints only
    src = jnp.full((n_blocks * bsz,), t, jnp.int32).at[row].set(jnp.arange(n, dtype=jnp.int32) // k)
    block_expert = jnp.clip(
        jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_blocks) * bsz, side="right"), 0, n_experts - 1
    )
    n_used = (jnp.sum(padded) // bsz).astype(jnp.int32)
    return BlockPlan(row, src.reshape(n_blocks, bsz), block_expert.astype(jnp.int32), n_used)


def _combine(out_rows: jax.Array, row: jax.Array, gates: jax.Array) -> jax.Array:
    """Each token's gate-weighted sum of its k assignments' rows. out_rows: [rows, din]."""
    t, k = gates.shape
    per = out_rows[row].reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", per, gates.astype(per.dtype))


def dropless_blocks(h: jax.Array, idx: jax.Array, gates: jax.Array, w: dict) -> jax.Array:
    """Every assignment computed as one batched matmul over all blocks, each with its expert's weights.

    The same result as ``dropless_ragged`` with only batched matmuls. It computes every block the
    static bound allows (padding blocks too) and gathers a weight copy per block; ``dropless_loop``
    avoids both and is the CPU path. Kept as a second, loop-free reference.
    """
    t, k = idx.shape
    n_experts = w["w_gate"].shape[0]
    plan = block_plan(idx, n_experts, block_size(t * k, n_experts))
    h_pad = jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)])
    xs = h_pad[plan.src]
    be = plan.block_expert
    gate = jnp.einsum("nbd,ndf->nbf", xs, w["w_gate"][be])
    up = jnp.einsum("nbd,ndf->nbf", xs, w["w_up"][be])
    out = jnp.einsum("nbf,nfd->nbd", jax.nn.silu(gate) * up, w["w_down"][be])
    return _combine(out.reshape(-1, out.shape[-1]), plan.row, gates)


BLOCK_OVERHEAD = 1 / 6  # a block's fixed cost in rows, as a fraction of the largest block (measured ~80 of 512)


def cover_sizes(n_assignments: int, n_experts: int) -> tuple[int, ...]:
    """The loop's four block sizes: S (an expert's fair share rounded up to 8 x a multiple of 8), S/2, S/4, S/8."""
    unit = max(8, -(-n_assignments // n_experts // 8 // 8) * 8)
    return (8 * unit, 4 * unit, 2 * unit, unit)


def _cover_table(sizes: tuple[int, ...]) -> np.ndarray:
    """[units + 1, classes]: the cheapest cover of a remainder of r smallest-block units (r < S/unit + 1)
    by at most one block of each size, under the cost (rows + BLOCK_OVERHEAD * S) per block."""
    unit, overhead = sizes[-1], BLOCK_OVERHEAD * sizes[0]
    table = []
    for r in range(sizes[0] // unit + 1):
        best = None
        for combo in itertools.product((0, 1), repeat=len(sizes)):
            rows = sum(c * z for c, z in zip(combo, sizes, strict=True))
            if rows >= r * unit:
                cost = rows + overhead * sum(combo)
                if best is None or cost < best[0]:
                    best = (cost, combo)
        table.append(best[1])
    return np.asarray(table, np.int32)


class CoverPlan(NamedTuple):
    """Assignments sorted by expert; each expert's rows padded to a cover of blocks of several sizes."""

    row: jax.Array  # [t*k] each assignment's row in the padded layout
    src: jax.Array  # [rows] the token that fills each row (t = the zero row for padding)
    offsets: tuple  # per size: [bound] each block's first row
    experts: tuple  # per size: [bound] each block's expert
    counts: tuple  # per size: [] blocks of that size


def cover_plan(idx: jax.Array, n_experts: int, sizes: tuple[int, ...]) -> CoverPlan:
    """Each expert gets as many of the largest blocks as its rows fill, then the cheapest cover of the
    rest (``_cover_table``); its blocks are laid out largest first. Static bounds: the largest size
    has at most t*k/S + E blocks, every other size at most E (one per expert), and the layout at most
    t*k + E*S rows."""
    t, k = idx.shape
    n = t * k
    big, unit = sizes[0], sizes[-1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    load = jnp.bincount(flat, length=n_experts)
    full = load // big
    counts = jnp.asarray(_cover_table(sizes))[-(-(load - full * big) // unit)]  # [E, classes]
    counts = counts.at[:, 0].add(full.astype(jnp.int32))
    widths = counts * jnp.asarray(sizes, jnp.int32)  # [E, classes] rows of each size per expert
    padded = jnp.sum(widths, axis=1)
    padded_start = jnp.cumsum(padded) - padded
    starts = jnp.cumsum(load) - load
    expert_sorted = flat[order]
    row_sorted = padded_start[expert_sorted] + jnp.arange(n) - starts[expert_sorted]
    row = jnp.zeros_like(row_sorted).at[order].set(row_sorted)
    src = jnp.full((n + n_experts * big,), t, jnp.int32).at[row].set(jnp.arange(n, dtype=jnp.int32) // k)
    seg = padded_start[:, None] + jnp.cumsum(widths, axis=1) - widths  # [E, classes] each size's first row
    offsets, experts, totals = [], [], []
    for c, size in enumerate(sizes):
        bound = n // big + n_experts if c == 0 else n_experts
        ends = jnp.cumsum(counts[:, c])
        j = jnp.arange(bound)
        e = jnp.clip(jnp.searchsorted(ends, j, side="right"), 0, n_experts - 1)
        offsets.append((seg[e, c] + (j - (ends - counts[:, c])[e]) * size).astype(jnp.int32))
        experts.append(e.astype(jnp.int32))
        totals.append(ends[-1].astype(jnp.int32))
    return CoverPlan(row, src, tuple(offsets), tuple(experts), tuple(totals))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ffn_loop(sizes, h_pad, plan, w_gu, w_down):
    return _ffn_loop_fwd(sizes, h_pad, plan, w_gu, w_down)[0]


def _ffn_loop_fwd(sizes, h_pad, plan, w_gu, w_down):
    """One loop per block size over that size's blocks: gather the block's tokens, SwiGLU with its expert's weights."""
    f = w_down.shape[1]
    rows = plan.src.shape[0]
    out = jnp.zeros((rows, w_down.shape[2]), h_pad.dtype)
    gu_all = jnp.zeros((rows, 2 * f), h_pad.dtype)
    for c, size in enumerate(sizes):
        offsets, experts = plan.offsets[c], plan.experts[c]

        def body(i, carry, size=size, offsets=offsets, experts=experts):
            out, gu_all = carry
            off, e = offsets[i], experts[i]
            gu = h_pad[jax.lax.dynamic_slice_in_dim(plan.src, off, size)] @ w_gu[e]  # gate and up in one matmul
            act = jax.nn.silu(gu[:, :f]) * gu[:, f:]
            out = jax.lax.dynamic_update_slice_in_dim(out, act @ w_down[e], off, axis=0)
            return out, jax.lax.dynamic_update_slice_in_dim(gu_all, gu, off, axis=0)

        out, gu_all = jax.lax.fori_loop(0, plan.counts[c], body, (out, gu_all))
    return out, (h_pad, plan, w_gu, w_down, gu_all)


def _ffn_loop_bwd(sizes, res, g):
    """The same loops backwards; weight gradients accumulate per expert in fp32."""
    h_pad, plan, w_gu, w_down, gu_all = res
    f = w_down.shape[1]
    carry = (
        jnp.zeros(h_pad.shape, jnp.float32),
        jnp.zeros(w_gu.shape, jnp.float32),
        jnp.zeros(w_down.shape, jnp.float32),
    )
    for c, size in enumerate(sizes):
        offsets, experts = plan.offsets[c], plan.experts[c]

        def body(i, carry, size=size, offsets=offsets, experts=experts):
            dh, dw_gu, dw_down = carry
            off, e = offsets[i], experts[i]
            tok = jax.lax.dynamic_slice_in_dim(plan.src, off, size)
            rows = h_pad[tok]
            gu = jax.lax.dynamic_slice_in_dim(gu_all, off, size).astype(jnp.float32)
            gate, up = gu[:, :f], gu[:, f:]
            sig = jax.nn.sigmoid(gate)
            silu = gate * sig
            dout = jax.lax.dynamic_slice_in_dim(g, off, size)
            dw_down = dw_down.at[e].add(
                jnp.dot((silu * up).astype(dout.dtype).T, dout, preferred_element_type=jnp.float32)
            )
            dact = jnp.dot(dout, w_down[e].T, preferred_element_type=jnp.float32)
            dgate = dact * up * sig * (1.0 + gate * (1.0 - sig))
            dgu = jnp.concatenate([dgate, dact * silu], axis=-1).astype(rows.dtype)
            dw_gu = dw_gu.at[e].add(jnp.dot(rows.T, dgu, preferred_element_type=jnp.float32))
            dh = dh.at[tok].add(jnp.dot(dgu, w_gu[e].T, preferred_element_type=jnp.float32))
            return dh, dw_gu, dw_down

        carry = jax.lax.fori_loop(0, plan.counts[c], body, carry)
    dh, dw_gu, dw_down = carry
    return dh.astype(h_pad.dtype), None, dw_gu.astype(w_gu.dtype), dw_down.astype(w_down.dtype)


_ffn_loop.defvjp(_ffn_loop_fwd, _ffn_loop_bwd)


def dropless_loop(h: jax.Array, idx: jax.Array, gates: jax.Array, w: dict) -> jax.Array:
    """Every assignment computed by loops over blocks that hold assignments: the CPU fast path.

    Each expert's rows are covered by blocks of four sizes (``cover_plan``): as many blocks of
    about an expert's fair share as its rows fill, then the cheapest cover of the rest by halves,
    quarters and eighths, so padding stays small and most rows run in large matmuls. Against
    ``dropless_blocks`` it skips padding blocks, slices each block's expert weights instead of
    gathering a copy per block, and runs gate and up as one matmul; its hand-written backward is
    the same loops. Equal to ``dropless_ragged`` (tests/test_moe.py).
    """
    t, k = idx.shape
    n_experts = w["w_gate"].shape[0]
    sizes = cover_sizes(t * k, n_experts)
    plan = cover_plan(idx, n_experts, sizes)
    h_pad = jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)])
    w_gu = jnp.concatenate([w["w_gate"], w["w_up"]], axis=-1)
    out = _ffn_loop(sizes, h_pad, plan, w_gu, w["w_down"])
    return _combine(out, plan.row, gates)


def dropless_gathered(h: jax.Array, idx: jax.Array, gates: jax.Array, w: dict) -> jax.Array:
    """Every assignment computed with its expert's weights gathered per token: for a handful of
    tokens (a decoding step), where reading k experts beats any plan over all of them."""
    gate = jnp.einsum("td,tkdf->tkf", h, w["w_gate"][idx])
    up = jnp.einsum("td,tkdf->tkf", h, w["w_up"][idx])
    out = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(gate) * up, w["w_down"][idx])
    return jnp.einsum("tkd,tk->td", out, gates.astype(out.dtype))


LOOP_MIN_EXPERT_SIZE = 128 * 128  # din x f at which the loop beats one batched matmul on CPU
# experts from which the loop is taken whatever their size: with many small experts the batched blocks
# compute half again as many rows as there are assignments (a padding block per expert) and gather a
# weight copy per block. Measured 2026-12-07 (4,096 tokens, d 128, f 64, fwd+bwd): 64 experts top-8,
# loop 115 ms against blocks 149-170 ms; 8 experts top-2, loop 27 ms against 42 ms, where blocks stay
# (the tiny preset's path and numbers, and its compile time, which that pilot did not measure)
LOOP_MIN_EXPERTS = 32


def dropless(h: jax.Array, idx: jax.Array, gates: jax.Array, w: dict, impl: str = "auto") -> jax.Array:
    """Dropless dispatch by ``impl`` (``model.moe_impl``): ``auto`` is ragged_dot where the backend
    has grouped matmuls; on CPU the loop over used blocks for experts of at least 128 x 128 or for
    32 experts and more, the batched blocks below that (a few tiny experts: kept for the compile
    time and the numbers of the runs made so; the loop ran faster in a pilot there too); with fewer assignments than experts (a decoding step), each token's experts'
    weights gathered (``dropless_gathered``). All give the same numbers (tests/test_moe.py)."""
    if impl != "auto":
        return {"ragged": dropless_ragged, "blocks": dropless_blocks, "loop": dropless_loop}[impl](h, idx, gates, w)
    if idx.size <= w["w_gate"].shape[0]:  # fewer assignments than experts (decoding): gather their weights
        return dropless_gathered(h, idx, gates, w)
    if jax.default_backend() == "cpu":
        n_experts, din, f = w["w_gate"].shape
        loop = din * f >= LOOP_MIN_EXPERT_SIZE or n_experts >= LOOP_MIN_EXPERTS
        return dropless_loop(h, idx, gates, w) if loop else dropless_blocks(h, idx, gates, w)
    return dropless_ragged(h, idx, gates, w)


class Placement(NamedTuple):
    expert: jax.Array  # [t, k] expert that computes the assignment (after any spill)
    pos: jax.Array  # [t, k] slot within that expert
    kept: jax.Array  # [t, k] computed (False = dropped)
    gates: jax.Array  # [t, k] combine weight
    spilled: jax.Array  # [t, k] moved away from its original expert


def _ranks(expert: jax.Array, priority: jax.Array, valid: jax.Array, n_experts: int) -> jax.Array:
    """Rank of each valid item among the valid items of the same expert, by ascending priority."""
    n = expert.shape[0]
    key = jnp.where(valid, expert, n_experts)
    srt = jnp.lexsort((jnp.arange(n), priority, key))
    counts = jnp.bincount(key, length=n_experts + 1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n) - starts[key[srt]]
    return jnp.zeros((n,), rank_sorted.dtype).at[srt].set(rank_sorted)


def place_capacity(r: rt.Routing, capacity: int, drop_order: str) -> Placement:
    """First come (token position, or highest score) first served, ``capacity`` slots per expert."""
    t, k = r.idx.shape
    n_experts = r.scores.shape[-1]
    flat = r.idx.reshape(-1)
    if drop_order == "score":
        priority = -jnp.take_along_axis(r.log_scores, r.idx, axis=-1).reshape(-1)
    else:
        priority = jnp.arange(t * k, dtype=jnp.int32)
    pos = _ranks(flat, priority, jnp.ones_like(flat, bool), n_experts).reshape(t, k)
    kept = pos < capacity
    return Placement(r.idx, pos, kept, jnp.where(kept, r.gates, 0.0), jnp.zeros_like(kept))


def place_spill(r: rt.Routing, capacity: int, drop_order: str) -> Placement:
    """Capacity placement, then rounds over each token's next-ranked experts for what overflowed:
    as many rounds as the routing has next choices (``model.spill_choices``).

    In round j every token that still has an unplaced assignment offers one to its (k+j)-th
    choice; offers fill the room left in priority order. Capacity only ever fills, so when the
    rounds end no dropped assignment has a candidate expert with room.
    """
    first = place_capacity(r, capacity, drop_order)
    t, k = r.idx.shape
    n_experts = r.scores.shape[-1]
    if k >= n_experts:
        return first
    used0 = jnp.minimum(jnp.bincount(r.idx.reshape(-1), length=n_experts), capacity)
    tokens = jnp.arange(t)

    def round_(carry, cand):  # cand: [t] each token's next choice
        used, unplaced, expert, pos, gates, spilled = carry
        want = jnp.any(unplaced, axis=1)
        if drop_order == "score":
            priority = -r.log_scores[tokens, cand]
        else:
            priority = tokens
        slot = used[cand] + _ranks(cand, priority, want, n_experts)
        ok = want & (slot < capacity)
        first_free = jnp.argmax(unplaced, axis=1)
        put = (jnp.arange(k)[None, :] == first_free[:, None]) & ok[:, None]
        gate = jnp.exp(r.log_scores[tokens, cand] - r.log_norm)
        expert = jnp.where(put, cand[:, None], expert)
        pos = jnp.where(put, slot[:, None], pos)
        gates = jnp.where(put, gate[:, None], gates)
        spilled = spilled | put
        unplaced = unplaced & ~put
        used = used + jnp.bincount(cand, weights=ok.astype(used.dtype), length=n_experts)
        return (used, unplaced, expert, pos, gates, spilled), None

    init = (used0, ~first.kept, first.expert, first.pos, first.gates, first.spilled)
    (_, unplaced, expert, pos, gates, spilled), _ = jax.lax.scan(round_, init, r.order[:, k:].T)
    return Placement(expert, pos, ~unplaced, gates, spilled)


def run_placed(h: jax.Array, p: Placement, w: dict, capacity: int) -> jax.Array:
    """Gather tokens into [e, c] slots, run the experts, gather back and weight. h: [t, din]."""
    t, k = p.expert.shape
    n_experts = w["w_gate"].shape[0]
    n_slots = n_experts * capacity
    slot = jnp.where(p.kept, p.expert * capacity + p.pos, n_slots).reshape(-1)
    token = jnp.repeat(jnp.arange(t), k)
    # which token fills each slot (t = the zero row for empty slots); a scatter of ints only
    src = jnp.full((n_slots + 1,), t, jnp.int32).at[slot].set(token)[:n_slots]
    h_pad = jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)])
    out = expert_ffn(w, h_pad[src].reshape(n_experts, capacity, -1)).reshape(n_slots, -1)
    out_pad = jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])
    per = out_pad[slot].reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", per, jnp.where(p.kept, p.gates, 0.0).astype(per.dtype))


def routed_experts(
    h: jax.Array, r: rt.Routing, w: dict, m: ModelConfig, dispatch: str, runtime: pmesh.Runtime = pmesh.ONE
) -> tuple[jax.Array, dict]:
    """Routed experts' output [t, din] and what the dispatch did (drops, spills, tokens per expert)."""
    t, k = r.idx.shape
    n_experts = m.n_routed
    mesh = runtime.expert_mesh
    if mesh is not None:  # expert parallel: the transport decides; dropless = bounded rounds of every assignment
        grouped = lambda x, i, g, w: dropless(x, i, g, w, m.moe_impl)  # noqa: E731
        ops = ep.ExpertOps(expert_ffn, place_capacity, place_spill, _ranks, grouped)
        return ep.ep_routed_experts(h, r, w, m, mesh, ops, dropless=dispatch == "dropless")
    if dispatch == "dropless":
        y = dropless(h, r.idx, r.gates, w, m.moe_impl)
        done = rt.expert_load(r.idx, n_experts)
        zero = jnp.zeros((), jnp.float32)
        return y, {"dropped_frac": zero, "spilled_frac": zero, "tokens_per_expert": done}

    group = m.capacity_group or t // runtime.shards  # 0: each device's tokens, one group
    if t % group:
        raise ValueError(f"model.capacity_group={group} does not divide the {t} tokens of this batch")
    n_groups = t // group
    capacity = m.capacity(group)
    place = place_spill if dispatch == "spill" else place_capacity

    def one_group(hg, rg):
        p = place(rg, capacity, m.drop_order)
        return run_placed(hg, p, w, capacity), p

    split = lambda a: a.reshape((n_groups, group) + a.shape[1:])  # noqa: E731
    y, p = jax.vmap(one_group)(split(h), jax.tree.map(split, r))
    y = y.reshape(t, -1)
    kept = p.kept.reshape(t, k)
    done = jnp.zeros((n_experts,), jnp.float32).at[p.expert.reshape(-1)].add(kept.reshape(-1).astype(jnp.float32))
    stats = {
        "dropped_frac": 1.0 - jnp.mean(kept.astype(jnp.float32)),
        "spilled_frac": jnp.mean(p.spilled.astype(jnp.float32)),
        "tokens_per_expert": done,
    }
    return y, stats


def moe_block(
    p: dict, x: jax.Array, bias: jax.Array, m: ModelConfig, dispatch: str, runtime: pmesh.Runtime = pmesh.ONE
) -> tuple[jax.Array, dict, jax.Array]:
    """Shared experts + routed experts (in latent space when latent_dim > 0). x: [b, s, d].

    Returns the output, this layer's router/dispatch metrics and the bias for the next step.
    """
    b, s, d = x.shape
    xt = x.reshape(b * s, d)
    logits = jnp.dot(xt.astype(jnp.float32), p["router"].astype(jnp.float32))
    r = rt.route(logits, bias, m, runtime)
    h = xt
    if m.latent_dim:
        h = rms_norm(xt @ p["latent_down"], p["latent_norm"], m.norm_eps)
    experts = {name: p[name] for name in ("w_gate", "w_up", "w_down")}
    y, stats = routed_experts(h, r, experts, m, dispatch, runtime)
    if m.latent_dim:
        y = y @ p["latent_up"]
    if m.n_shared:
        y = y + swiglu(xt, p["shared_gate"], p["shared_up"], p["shared_down"])
    load = rt.expert_load(r.idx, m.n_routed)
    metrics = dict(
        stats,
        expert_load=load,
        max_mean_load=jnp.max(load) / jnp.mean(load),
        router_entropy=rt.router_entropy(r.log_scores),
        router_z=rt.router_z_loss(logits),
        aux_loss=rt.switch_aux_loss(r.log_scores, r.idx, m.n_routed),
        bias_mean=jnp.mean(bias),
        bias_std=jnp.std(bias),
    )
    if runtime.whole_batch:  # a micro-step: the step updates the bias from the whole batch's statistics
        metrics["bias_stat"] = jax.lax.stop_gradient(rt.bias_stat(r, bias, m, runtime))
        metrics["aux_terms"] = jax.lax.stop_gradient(rt.aux_terms(r.log_scores, r.idx, m.n_routed))
        return y.reshape(b, s, d), metrics, bias
    new_bias = jax.lax.stop_gradient(rt.next_bias(r, bias, m, runtime))
    return y.reshape(b, s, d), metrics, new_bias
