"""Expert-parallel transports under ``jax.shard_map``: tokens travel to the devices that hold
their experts over the mesh's ``expert`` axis, and back.

Each device holds ``E / D`` routed experts (D = size of the ``expert`` axis) and its share of
the batch's tokens, already routed. ``model.ep_transport`` chooses how they travel:

- ``fixed``: every (sender, expert) pair has ``C = ceil(CF * t * k / E)`` slots (t = the
  sender's tokens); a sender ranks its assignments per expert by token position and drops what
  overflows; one ``all_to_all`` out, the local experts compute on their buffer, one back.
- dropless (``model.dispatch: dropless``, whatever the transport): every assignment travels, in
  rounds of ``B = max(1, t*k // D)`` rows per (sender, destination), so that no buffer holds more
  than ``max(t*k, D)`` rows; a round computes its rows with the model's grouped dropless kernel.
  Balanced routing needs one or two rounds; all of a token's assignments landing on one device
  needs ``ceil(t*min(k, E/D) / B)``. The rounds run in a ``while_loop`` whose hand-written
  backward replays each round, so nothing per round is kept for the gradient.
- ``spill``: as ``fixed``, but an overflowing assignment first moves to the token's next-ranked
  expert that still has room at the sender (the single-device spill rule, per sender).
- ``pooled_wave``: per destination device one pool of ``ceil(CF * t * k / D)`` slots shared by
  its experts, the expert id carried beside each row, sent in W waves (``model.ep_waves``); the
  receiver fills each local expert's ``D * C`` slots round-robin across senders (slot j of every
  sender before slot j + 1 of any), so that no sender is always the one cut. Sender drops (pool
  full) and receiver drops (expert full) are counted apart.

The experts' computation and the placement rules come in ``ops`` (an ``ExpertOps``: the model's
single-device ``expert_ffn``, ``place_capacity``, ``place_spill`` and ranking), so this module knows
nothing of the model.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moelab.parallel.mesh import BATCH


class ExpertOps(NamedTuple):
    """What the transports need of the model: its expert computation and placement rules."""

    ffn: Any  # (w, rows [e, c, din]) -> [e, c, din]
    place_capacity: Any  # (routing, capacity, drop_order) -> placement
    place_spill: Any
    ranks: Any  # (keys, priority, valid, n) -> each item's rank among those with its key
    grouped: Any  # (rows [n, din], idx [n, 1], gates [n, 1], w) -> [n, din]: dropless on local experts


AXIS = "expert"


def slots_per_expert(cf: float, tokens: int, k: int, n_experts: int) -> int:
    """C: slots per (sender, expert) pair; never more than the sender's tokens (then nothing drops)."""
    return min(int(math.ceil(cf * tokens * k / n_experts)), tokens)


def pool_size(cf: float, tokens: int, k: int, n_dev: int, local: int) -> int:
    """Slots per (sender, destination device) pool; never more than can be sent there."""
    return min(int(math.ceil(cf * tokens * k / n_dev)), tokens * min(k, local))


def _gather_rows(h: jax.Array, src: jax.Array) -> jax.Array:
    """Rows of h by index, index len(h) giving a zero row."""
    return jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)])[src]


def _send_back(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, AXIS, 0, 0)


def _per_expert(h, r, w, capacity: int, n_dev: int, spill: bool, drop_order: str, ops: ExpertOps):
    """fixed and spill, on one device: place locally, exchange [D, E/D, C] buffers, compute, return."""
    t, k = r.idx.shape
    n_experts = r.scores.shape[-1]
    local = n_experts // n_dev
    place = ops.place_spill if spill else ops.place_capacity
    p = place(r, capacity, drop_order)
    n_slots = n_experts * capacity
    slot = jnp.where(p.kept, p.expert * capacity + p.pos, n_slots).reshape(-1)
    token = jnp.repeat(jnp.arange(t, dtype=jnp.int32), k)
    src = jnp.full((n_slots + 1,), t, jnp.int32).at[slot].set(token)[:n_slots]
    send = _gather_rows(h, src).reshape(n_dev, local, capacity, -1)
    recv = jax.lax.all_to_all(send, AXIS, 0, 0)  # [senders, local experts, C, din]
    x = recv.transpose(1, 0, 2, 3).reshape(local, n_dev * capacity, -1)
    out = ops.ffn(w, x).reshape(local, n_dev, capacity, -1).transpose(1, 0, 2, 3)
    back = _send_back(out).reshape(n_slots, -1)
    per = _gather_rows(back, slot).reshape(t, k, -1)
    y = jnp.einsum("tkd,tk->td", per, jnp.where(p.kept, p.gates, 0.0).astype(per.dtype))
    n = jnp.float32(t * k)
    sent = jnp.sum(p.kept)
    stats = {
        "assignments": n,
        "sender_dropped": n - sent,
        "receiver_dropped": jnp.float32(0.0),
        "spilled": jnp.sum(p.spilled).astype(jnp.float32),
        "done": jnp.zeros((n_experts,), jnp.float32).at[p.expert.reshape(-1)].add(p.kept.reshape(-1)),
    }
    return y, stats


def _pooled_wave(h, r, w, cf: float, n_dev: int, waves: int, ops: ExpertOps):
    """pooled_wave on one device: one pool per destination, W waves, round-robin receiver fill."""
    t, k = r.idx.shape
    n_experts = r.scores.shape[-1]
    local = n_experts // n_dev
    pool = pool_size(cf, t, k, n_dev, local)
    per_wave = -(-pool // waves)
    padded = per_wave * waves
    flat = r.idx.reshape(-1)
    dest = flat // local
    pos = ops.ranks(dest, jnp.arange(t * k, dtype=jnp.int32), jnp.ones_like(flat, bool), n_dev)
    sent = pos < pool
    slot = jnp.where(sent, dest * padded + pos, n_dev * padded)
    token = jnp.repeat(jnp.arange(t, dtype=jnp.int32), k)
    src = jnp.full((n_dev * padded + 1,), t, jnp.int32).at[slot].set(token)[: n_dev * padded]
    ids = jnp.full((n_dev * padded + 1,), -1, jnp.int32).at[slot].set(flat % local)[: n_dev * padded]
    rows = _gather_rows(h, src).reshape(n_dev, waves, per_wave, -1)
    ids = ids.reshape(n_dev, waves, per_wave)
    recv_rows, recv_ids = [], []
    for j in range(waves):  # one exchange per wave: [destinations, rows of this wave]
        recv_rows.append(jax.lax.all_to_all(rows[:, j], AXIS, 0, 0))
        recv_ids.append(jax.lax.all_to_all(ids[:, j], AXIS, 0, 0))
    # items in round-robin order: (wave, row within the wave, sender)
    items = jnp.stack(recv_rows).transpose(0, 2, 1, 3).reshape(waves * per_wave * n_dev, -1)
    item_ids = jnp.stack(recv_ids).transpose(0, 2, 1).reshape(-1)
    n_items = item_ids.shape[0]
    valid = item_ids >= 0
    capacity = n_dev * slots_per_expert(cf, t, k, n_experts)  # each local expert's slots, all senders
    rank = ops.ranks(jnp.where(valid, item_ids, 0), jnp.arange(n_items, dtype=jnp.int32), valid, local)
    kept = valid & (rank < capacity)
    rslot = jnp.where(kept, item_ids * capacity + rank, local * capacity)
    fill = jnp.full((local * capacity + 1,), n_items, jnp.int32).at[rslot].set(jnp.arange(n_items, dtype=jnp.int32))
    x = _gather_rows(items, fill[: local * capacity]).reshape(local, capacity, -1)
    out = ops.ffn(w, x).reshape(local * capacity, -1)
    per_item = _gather_rows(out, rslot).reshape(waves, per_wave, n_dev, -1).transpose(0, 2, 1, 3)
    kept_item = kept.reshape(waves, per_wave, n_dev).transpose(0, 2, 1)
    back = jnp.stack([_send_back(per_item[j]) for j in range(waves)], axis=1)  # [dest, waves, rows, din]
    kept_back = jnp.stack([_send_back(kept_item[j]) for j in range(waves)], axis=1)
    back = back.reshape(n_dev * padded, -1)
    done_flag = jnp.concatenate([kept_back.reshape(-1), jnp.zeros((1,), bool)])[slot]
    per = _gather_rows(back, slot).reshape(t, k, -1)
    ok = done_flag.reshape(t, k)
    y = jnp.einsum("tkd,tk->td", per, jnp.where(ok, r.gates, 0.0).astype(per.dtype))
    n = jnp.float32(t * k)
    stats = {
        "assignments": n,
        "sender_dropped": n - jnp.sum(sent),
        "receiver_dropped": jnp.sum(valid & ~kept).astype(jnp.float32),
        "spilled": jnp.float32(0.0),
        "done": jnp.zeros((n_experts,), jnp.float32).at[flat].add(ok.reshape(-1)),
    }
    return y, stats


def round_rows(t: int, k: int, n_dev: int) -> int:
    """B: rows per (sender, destination) in one dropless round; D * B <= max(t * k, D)."""
    return max(1, (t * k) // n_dev)


def _exchange_round(j, h, gates, w, dest, pos, lid, n_dev: int, rows: int, ops: ExpertOps):
    """Round j of the dropless exchange on one device: the assignments ranked [j*B, (j+1)*B) within
    their destination travel, compute on their local expert, come back; the gate-weighted sum."""
    t, k = gates.shape
    n = n_dev * rows
    here = pos // rows == j
    slot = jnp.where(here, dest * rows + pos % rows, n).reshape(-1)
    token = jnp.repeat(jnp.arange(t, dtype=jnp.int32), k)
    src = jnp.full((n + 1,), t, jnp.int32).at[slot].set(token)[:n]
    ids = jnp.full((n + 1,), -1, jnp.int32).at[slot].set(lid.reshape(-1))[:n]
    recv = jax.lax.all_to_all(_gather_rows(h, src).reshape(n_dev, rows, -1), AXIS, 0, 0).reshape(n, -1)
    recv_ids = jax.lax.all_to_all(ids.reshape(n_dev, rows), AXIS, 0, 0).reshape(n)
    valid = recv_ids >= 0
    out = ops.grouped(recv, jnp.maximum(recv_ids, 0)[:, None], valid[:, None].astype(recv.dtype), w)
    back = _send_back(out.reshape(n_dev, rows, -1)).reshape(n, -1)
    per = _gather_rows(back, slot).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", per, jnp.where(here, gates, 0.0).astype(per.dtype))


def _dropless_rounds(h, r, w, n_dev: int, ops: ExpertOps):
    """Dropless over the expert axis with bounded buffers (see the module docstring)."""
    t, k = r.idx.shape
    local = r.scores.shape[-1] // n_dev
    rows = round_rows(t, k, n_dev)
    dest = r.idx // local
    flat = dest.reshape(-1)
    pos = ops.ranks(flat, jnp.arange(t * k, dtype=jnp.int32), jnp.ones_like(flat, bool), n_dev).reshape(t, k)
    most = jax.lax.pmax(jnp.max(jnp.bincount(flat, length=n_dev)), BATCH)  # the same on every device
    n_rounds = (most + rows - 1) // rows
    plan = (dest, pos, r.idx % local, n_rounds)

    def one(j, h, gates, w, plan):
        return _exchange_round(j, h, gates, w, *plan[:3], n_dev, rows, ops)

    # every device has at least one round; round 0 runs outside the loops so the carries start with
    # the types (and the shard_map's varying axes) of what the rounds add

    @jax.custom_vjp
    def exchange(h, gates, w, plan):
        first = one(0, h, gates, w, plan)
        return jax.lax.fori_loop(1, plan[3], lambda j, y: y + one(j, h, gates, w, plan), first)

    def fwd(h, gates, w, plan):
        return exchange(h, gates, w, plan), (h, gates, w, plan)

    def bwd(res, dy):
        h, gates, w, plan = res

        def pull(j):
            return jax.vjp(lambda h, g, w: one(j, h, g, w, plan), h, gates, w)[1](dy)

        step = lambda j, acc: jax.tree.map(jnp.add, acc, pull(j))  # noqa: E731
        dh, dg, dw = jax.lax.fori_loop(1, plan[3], step, pull(0))
        return dh, dg, dw, jax.tree.map(lambda _: None, plan)

    exchange.defvjp(fwd, bwd)
    y = exchange(h, r.gates, w, plan)
    n = jnp.float32(t * k)
    zero = jnp.float32(0.0)
    stats = {
        "assignments": n,
        "sender_dropped": zero,
        "receiver_dropped": zero,
        "spilled": zero,
        "done": jnp.zeros((r.scores.shape[-1],), jnp.float32).at[r.idx.reshape(-1)].add(1.0),
    }
    return y, stats


def ep_routed_experts(
    h: jax.Array, r, w: dict, m, mesh, ops: ExpertOps, dropless: bool = False
) -> tuple[jax.Array, dict]:
    """The routed experts' output [t, din] with tokens exchanged over the mesh's expert axis.

    ``dropless``: every assignment computed, in bounded rounds, whatever the transport.
    """
    n_dev = mesh.shape[AXIS]
    n_shards = mesh.shape["data"] * n_dev
    t, k = r.idx.shape
    if t % n_shards:
        raise ValueError(f"the batch's {t} tokens do not split over {n_shards} devices")
    t_local = t // n_shards
    transport = "dropless" if dropless else m.ep_transport
    cf = m.capacity_factor

    def body(h, r, w):
        if transport == "dropless":
            y, s = _dropless_rounds(h, r, w, n_dev, ops)
        elif transport == "pooled_wave":
            y, s = _pooled_wave(h, r, w, cf, n_dev, m.ep_waves, ops)
        else:
            cap = slots_per_expert(cf, t_local, k, m.n_routed)
            y, s = _per_expert(h, r, w, cap, n_dev, transport == "spill", m.drop_order, ops)
        s = jax.tree.map(lambda v: jax.lax.psum(v, BATCH), s)
        return y, s

    routing_specs = type(r)(*([P(BATCH)] * len(r)))
    w_specs = {name: P(AXIS) for name in w}
    stat_specs = {k: P() for k in ("assignments", "sender_dropped", "receiver_dropped", "spilled", "done")}
    y, s = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(BATCH), routing_specs, w_specs),
        out_specs=(P(BATCH), stat_specs),
    )(h, r, w)
    n = s["assignments"]
    stats = {
        "dropped_frac": (s["sender_dropped"] + s["receiver_dropped"]) / n,
        "spilled_frac": s["spilled"] / n,
        "sender_dropped_frac": s["sender_dropped"] / n,
        "receiver_dropped_frac": s["receiver_dropped"] / n,
        "tokens_per_expert": s["done"],
    }
    return y, stats
