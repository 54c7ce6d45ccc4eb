"""Expert parallelism on 8 simulated CPU devices: every transport equals the single-device model
with ample capacity, drops equal single-device simulations of the same rule at a tight one, and
pooled/wave's receiver shares the cut across senders."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import config_from_dict
from moelab.model import moe
from moelab.model import router as rt
from moelab.model.moe import moe_block
from moelab.model.transformer import init_params
from moelab.parallel import mesh as pmesh
from moelab.parallel.ep import ExpertOps, ep_routed_experts, pool_size, slots_per_expert
from reference import jaxpr_eqns, moe_reference, reference_choices

TRANSPORTS = ["fixed", "spill", "pooled_wave"]


OPS = ExpertOps(moe.expert_ffn, moe.place_capacity, moe.place_spill, moe._ranks, moe.dropless)


def mesh_of(data, expert):
    assert jax.device_count() == 8, "conftest sets 8 simulated devices"
    return pmesh.auto_mesh(data, expert)


def layer(**model):
    base = dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, n_routed=16, top_k=2, expert_dim=8, n_shared=1,
                shared_dim=12, latent_dim=0, vocab_size=32, seq_len=16)  # fmt: skip
    base.update(model)
    m = config_from_dict({"model": base, "train": {"batch_size": 4}}).model
    p = jax.tree.map(lambda a: a[0], init_params(m, jax.random.PRNGKey(0))["layers"])
    p["router"] = p["router"] * 3.0
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, m.d_model))
    bias = 0.3 * jax.random.normal(jax.random.PRNGKey(2), (m.n_routed,))
    return m, p, x, bias


def run_block(m, p, x, bias, dispatch, mesh=None):
    runtime = pmesh.Runtime(mesh)
    probe = jax.random.normal(jax.random.PRNGKey(3), x.shape)

    def f(p, x):
        y, metrics, _ = moe_block(p, x, bias, m, dispatch, runtime)
        return jnp.sum(y * probe), (y, metrics)

    (_, (y, metrics)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(p, x)
    return y, metrics, grads


LATENT = dict(latent_dim=8, n_shared=2, router="sigmoid", routed_scale=2.5)


@pytest.mark.parametrize(
    "transport,case,shape",
    [("fixed", dict(latent_dim=0, n_shared=0), (1, 8)), ("fixed", dict(latent_dim=0, n_shared=1), (2, 4)),
     ("fixed", LATENT, (1, 8)), ("spill", LATENT, (2, 4)), ("pooled_wave", LATENT, (1, 8)),
     ("pooled_wave", dict(latent_dim=0, n_shared=1), (2, 4))],
    ids=["fixed-plain-1x8", "fixed-shared-2x4", "fixed-latent-shared-1x8", "spill-latent-shared-2x4",
         "pooled-latent-shared-1x8", "pooled-shared-2x4"],
)  # fmt: skip
def test_ample_capacity_equals_single_device_dropless(transport, case, shape):
    m, p, x, bias = layer(**case, ep_transport=transport, capacity_factor=16.0)  # C = every token
    y_ref, _, g_ref = run_block(m, p, x, bias, "dropless")
    y, metrics, g = run_block(m, p, x, bias, "capacity", mesh_of(*shape))
    assert float(metrics["dropped_frac"]) == 0.0
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport,single,cf,e", [("fixed", "capacity", 1.0, 16), ("spill", "spill", 0.5, 8)])
def test_tight_capacity_drops_equal_the_single_device_rule(transport, single, cf, e):
    # 64 tokens on 8 devices: the single-device rule with one capacity group per device's 8 tokens
    m, p, x, bias = layer(n_routed=e, n_shared=0, ep_transport=transport, capacity_factor=cf, capacity_group=8)
    y_ref, ref, _ = run_block(m, p, x, bias, single)
    y, ep, _ = run_block(m, p, x, bias, "capacity", mesh_of(1, 8))
    assert float(ref["dropped_frac"]) > 0.05  # tight enough to drop
    assert transport == "fixed" or float(ref["spilled_frac"]) > 0.01  # and to spill
    assert float(ep["dropped_frac"]) == pytest.approx(float(ref["dropped_frac"]), abs=1e-7)
    assert float(ep["spilled_frac"]) == pytest.approx(float(ref["spilled_frac"]), abs=1e-7)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    if transport == "fixed":  # and the rule itself, by hand: in each device's 8 tokens, first come first kept
        choices = reference_choices(p, x, bias, m)
        cap = math.ceil(cf * 8 * m.top_k / e)
        keep, used = {}, {}
        for t in range(len(choices)):
            for j, expert in enumerate(choices[t]):
                slot = (t // 8, int(expert))
                keep[(t, j)] = used.get(slot, 0) < cap
                used[slot] = used.get(slot, 0) + 1
        assert float(ep["dropped_frac"]) == pytest.approx(1 - np.mean(list(keep.values())), abs=1e-7)
        np.testing.assert_allclose(y, moe_reference(p, x, bias, m, keep=keep), rtol=1e-4, atol=1e-5)


def pooled_reference(idx: np.ndarray, n_dev: int, n_experts: int, cf: float, waves: int):
    """Pooled/wave's rule by hand, with loops: idx [devices, t, k] -> (sender drops, receiver drops,
    kept [devices, t, k])."""
    d, t, k = idx.shape
    local = n_experts // n_dev
    pool = min(math.ceil(cf * t * k / n_dev), t * min(k, local))
    per_wave = -(-pool // waves)
    cap = n_dev * min(math.ceil(cf * t * k / n_experts), t)
    sent = np.zeros(idx.shape, bool)
    queue = {dest: [[] for _ in range(d)] for dest in range(n_dev)}  # dest -> sender -> assignments in order
    for s in range(d):
        count = [0] * n_dev
        for i in range(t):
            for j in range(k):
                dest = idx[s, i, j] // local
                if count[dest] < pool:
                    sent[s, i, j] = True
                    queue[dest][s].append((i, j))
                count[dest] += 1
    kept = np.zeros(idx.shape, bool)
    for dest in range(n_dev):
        used = [0] * local
        for row in range(per_wave * waves):  # wave by wave, row by row, then sender by sender
            for s in range(d):
                if row < len(queue[dest][s]):
                    i, j = queue[dest][s][row]
                    e = idx[s, i, j] % local
                    if used[e] < cap:
                        used[e] += 1
                        kept[s, i, j] = True
    return int((~sent).sum()), int((sent & ~kept).sum()), kept


@pytest.mark.parametrize("cf,waves", [(1.0, 3), (1.25, 1), (0.75, 2)])
def test_pooled_wave_drops_equal_the_rule_by_hand(cf, waves):
    m, p, x, bias = layer(n_shared=0, top_k=2, ep_transport="pooled_wave", ep_waves=waves, capacity_factor=cf)
    xt = x.reshape(-1, m.d_model)
    r = rt.route(xt @ p["router"], bias, m)
    w = {n: p[n] for n in ("w_gate", "w_up", "w_down")}
    mesh = mesh_of(1, 8)
    y, stats = jax.jit(lambda h, r, w: ep_routed_experts(h, r, w, m, mesh, OPS))(xt, r, w)
    idx = np.asarray(r.idx).reshape(8, -1, m.top_k)
    sender, receiver, kept = pooled_reference(idx, 8, m.n_routed, cf, waves)
    n = idx.size
    assert float(stats["sender_dropped_frac"]) * n == pytest.approx(sender)
    assert float(stats["receiver_dropped_frac"]) * n == pytest.approx(receiver)
    assert sender + receiver > 0
    # the output leaves out exactly the dropped assignments
    ok = jnp.asarray(kept.reshape(-1, m.top_k))
    from moelab.model.moe import expert_ffn

    def one(h, e, g, keep):
        ws = jax.tree.map(lambda a: a[e], w)
        out = expert_ffn(jax.tree.map(lambda a: a[None], ws), h[None, None])[0, 0]
        return jnp.where(keep, g, 0.0) * out

    want = jax.vmap(lambda h, es, gs, ks: sum(one(h, es[j], gs[j], ks[j]) for j in range(m.top_k)))(
        xt, r.idx, r.gates, ok
    )
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def exchanged_rows(fn, *args) -> list[int]:
    """Rows of every all_to_all operand in fn's program (leading [devices, rows] dims multiplied)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [math.prod(e.invars[0].aval.shape[:2]) for e in jaxpr_eqns(jaxpr) if e.primitive.name == "all_to_all"]


@pytest.mark.parametrize(
    "case,shape",
    [
        (dict(latent_dim=0, n_shared=0), (1, 8)),
        pytest.param(LATENT, (2, 4), marks=pytest.mark.slow),
        pytest.param(dict(n_routed=8, top_k=3, n_shared=0), (1, 8), marks=pytest.mark.slow),
    ],
    ids=["plain-1x8", "latent-shared-2x4", "top3-of-8-1x8"],
)
def test_dropless_equals_one_device_with_buffers_of_at_most_t_times_k_rows(case, shape):
    m, p, x, bias = layer(**case)
    y_ref, _, g_ref = run_block(m, p, x, bias, "dropless")
    mesh = mesh_of(*shape)
    y, metrics, g = run_block(m, p, x, bias, "dropless", mesh)
    assert float(metrics["dropped_frac"]) == 0.0
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # every buffer that travels, forward and backward, holds at most t*k rows (t = one device's tokens)
    t = x.shape[0] * x.shape[1] // 8
    on_mesh = pmesh.Runtime(mesh)
    grad = jax.grad(lambda p, x: jnp.sum(moe_block(p, x, bias, m, "dropless", on_mesh)[0]), argnums=(0, 1))
    rows = exchanged_rows(grad, p, x)
    assert len(rows) >= 4  # out and back, forward and backward
    assert max(rows) <= max(t * m.top_k, 8), rows


def test_dropless_in_rounds_when_every_token_goes_to_one_device():
    """All 64 tokens routed to experts 0 and 1 (device 0), top-2: each sender has 16 assignments
    for device 0 and rounds of 8 // 8 * 2 = 2 rows, so 8 rounds; the output and the gradients
    equal one device's dropless, and no buffer grows."""
    m, p, _, _ = layer(n_shared=0, top_k=2, router="softmax")
    w = {n: p[n] for n in ("w_gate", "w_up", "w_down")}
    h = jax.random.normal(jax.random.PRNGKey(4), (64, m.d_model))
    logits = jnp.full((64, m.n_routed), -10.0).at[:, 0].set(10.0).at[:, 1].set(9.0)
    r = rt.route(logits, jnp.zeros((m.n_routed,)), m)
    assert set(np.asarray(r.idx).ravel()) == {0, 1}
    mesh = mesh_of(1, 8)
    probe = jax.random.normal(jax.random.PRNGKey(5), h.shape)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda h, g, w: jnp.sum(fn(h, g, w) * probe), argnums=(0, 1, 2)))

    def on_mesh(h, g, w):
        return ep_routed_experts(h, r._replace(gates=g), w, m, mesh, OPS, dropless=True)[0]

    want, g_want = loss(lambda h, g, w: moe.dropless(h, r.idx, g, w))(h, r.gates, w)
    got, g_got = loss(on_mesh)(h, r.gates, w)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert (
        max(exchanged_rows(jax.grad(lambda h, g, w: jnp.sum(on_mesh(h, g, w)), argnums=(0, 1, 2)), h, r.gates, w)) == 16
    )


def forced_routing(m, dest_expert: np.ndarray):
    """Routing with token i sent to expert dest_expert[i] (top-1)."""
    logits = jnp.full((len(dest_expert), m.n_routed), -10.0).at[jnp.arange(len(dest_expert)), dest_expert].set(10.0)
    return rt.route(logits, jnp.zeros((m.n_routed,)), m)


def test_pooled_wave_shares_the_cut_across_senders():
    # 16 experts on 8 devices (2 each), top-1, 8 tokens per device, CF 2: a pool of 2 rows per
    # destination, and 8 x ceil(2 * 8 / 16) = 8 slots per expert at the receiver
    m, p, x, bias = layer(n_shared=0, top_k=1, ep_transport="pooled_wave", ep_waves=1, capacity_factor=2.0,
                          router="softmax")  # fmt: skip
    assert pool_size(2.0, 8, 1, 8, 2) == 2 and 8 * slots_per_expert(2.0, 8, 1, 16) == 8
    w = {n: p[n] for n in ("w_gate", "w_up", "w_down")}
    h = jnp.ones((64, m.d_model))
    mesh = mesh_of(1, 8)

    def kept_per_sender(dest):
        y, stats = jax.jit(lambda h, r: ep_routed_experts(h, r, w, m, mesh, OPS))(h, forced_routing(m, dest))
        done = np.abs(np.asarray(y)).sum(axis=1) > 0
        return done.reshape(8, 8).sum(axis=1), stats

    # every sender sends two tokens to expert 0: 16 rows for its 8 slots; each sender keeps one
    dest = np.tile(np.array([0, 0, 2, 4, 6, 8, 10, 12]), 8)
    kept, stats = kept_per_sender(dest)
    assert list(kept) == [7] * 8  # 6 elsewhere + 1 of the 2 for expert 0, for every sender alike
    assert float(stats["receiver_dropped_frac"]) * 64 == 8
    # one sender overloaded (two rows for expert 0, the others one): the cut lands on it, not on the last
    dest = np.tile(np.array([0, 2, 4, 6, 8, 10, 12, 14]), 8)
    dest[1] = 0
    kept, stats = kept_per_sender(dest)
    assert float(stats["receiver_dropped_frac"]) * 64 == 1
    assert list(kept) == [7] + [8] * 7


def test_quantile_bias_on_a_mesh_counts_instead_of_gathering():
    """The quantile bias with the tokens split over 8 devices equals one device's jnp.quantile,
    and the compiled program moves no [tokens, experts] array: no all-gather, only [experts]
    counts summed across devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    t, e, k = 1024, 32, 4
    logits = jax.random.normal(jax.random.PRNGKey(0), (t, e)) * 2.0
    logits = logits.at[::7, 3].set(1.25)  # ties
    bias = 0.2 * jax.random.normal(jax.random.PRNGKey(1), (e,))
    ref = rt.quantile_bias(logits, bias, k)  # one device: jnp.quantile
    mesh = mesh_of(2, 4)
    on_mesh = pmesh.Runtime(mesh)
    sharded = jax.device_put(logits, NamedSharding(mesh, P(pmesh.BATCH)))
    fn = jax.jit(lambda x, b: rt.quantile_bias(x, b, k, on_mesh))
    got = fn(sharded, bias)
    hlo = fn.lower(sharded, bias).compile().as_text()
    m = config_from_dict({"model": {"n_routed": e, "top_k": k, "n_kv_heads": 1, "spill_choices": 2}}).model
    route = jax.jit(lambda x, b: rt.route(x, b, m, on_mesh).order)  # the top choices, each device its own tokens
    order = route(sharded, bias)
    route_hlo = route.lower(sharded, bias).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-6)
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    assert "all-reduce" in hlo  # the counts
    np.testing.assert_array_equal(np.asarray(order), np.asarray(rt.route(logits, bias, m).order))
    assert "all-gather" not in route_hlo


def test_capacity_groups_are_each_devices_tokens_under_a_data_mesh():
    """capacity_group 0 on an 8 x 1 mesh (no EP): one group per device's tokens, as Marin groups;
    the same as one device with groups of t / 8, and not the one whole-batch group."""
    import dataclasses

    m, p, x, bias = layer(capacity_factor=0.5)
    y, metrics, g = run_block(m, p, x, bias, "capacity", mesh_of(8, 1))
    per_device = dataclasses.replace(m, capacity_group=x.shape[0] * x.shape[1] // 8)
    y_ref, m_ref, g_ref = run_block(per_device, p, x, bias, "capacity")
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert float(metrics["dropped_frac"]) == pytest.approx(float(m_ref["dropped_frac"]))
    _, m_whole, _ = run_block(m, p, x, bias, "capacity")  # one device: the whole batch is one group
    assert float(m_whole["dropped_frac"]) != pytest.approx(float(metrics["dropped_frac"]))


# ------------------------------------------------------------------ training with EP from the CLI

from conftest import MICRO, ROOT  # noqa: E402


def _train(corpus, out, *extra, env=None):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "moelab", "train", "tiny", "--out", str(out), "--steps", "20", "--quiet",
           "--data", corpus["code"], "--data", corpus["prose"]]  # fmt: skip
    for o in MICRO + ["train.batch_size=8", "model.capacity_factor=4.0", "train.checkpoint_every=10"]:
        cmd += ["--set", o]
    cmd += list(extra)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=600)


def _losses(out):
    from moelab.runs import read_jsonl

    return np.array([r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"])


def _evals(out):
    """Each evaluation's held-out loss, dropless, per domain and macro."""
    from moelab.runs import read_jsonl

    return [r["loss_dropless"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]


@pytest.fixture(scope="module")
def single_device_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "single"
    res = _train(corpus, out)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def ep_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "ep8"
    res = _train(corpus, out, "--devices", "8", "--set", "mesh.expert=8")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.slow  # two 20-step CLI runs (~45 s); the forward/grad equivalence tests stay in the default run
def test_ep_training_equals_single_device(single_device_run, ep_run):
    ep, ref = _losses(ep_run), _losses(single_device_run)
    assert len(ep) == len(ref) == 20
    np.testing.assert_allclose(ep, ref, rtol=0, atol=1e-4)
    assert ep[-1] < ep[0] - 0.2  # and it trains
    # evaluated under the mesh (the transports, dropless), as one device evaluates
    for got, want in zip(_evals(ep_run), _evals(single_device_run), strict=True):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.slow  # FSDP (4 x 2): parameters and optimizer state over data, experts also over expert
def test_fsdp_training_equals_single_device(corpus, single_device_run, tmp_path):
    out = tmp_path / "fsdp"
    res = _train(corpus, out, "--devices", "8", "--set", "mesh.data=4", "--set", "mesh.expert=2")
    assert res.returncode == 0, res.stderr[-3000:]
    got, ref = _losses(out), _losses(single_device_run)
    assert len(got) == len(ref) == 20
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
    for got_eval, want in zip(_evals(out), _evals(single_device_run), strict=True):
        assert got_eval == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("saved,restored", [((2, 4), None), (None, (1, 8))], ids=["8to1", "1to8"])
def test_a_checkpoint_restores_under_another_mesh(tmp_path, saved, restored):
    from moelab.config import load_config
    from moelab.train import checkpoint, optim
    from moelab.train.step import init_train_state

    cfg = load_config("tiny", MICRO + ["train.batch_size=8", "train.seed=3"])
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)

    def state_on(shape, seed):
        state = init_train_state(load_config(cfg, [f"train.seed={seed}"]), opt)
        return state if shape is None else pmesh.shard_tree(state, pmesh.auto_mesh(*shape))

    state = state_on(saved, 3)
    checkpoint.save(tmp_path / "ckpt", 10, state, {"step": 10}, keep_last=1, keep_every=0)
    template = state_on(restored, 4)  # another seed: nothing but shapes may come from the template
    back, meta = checkpoint.restore(tmp_path / "ckpt", 10, template)
    assert meta["step"] == 10
    for a, b, t in zip(jax.tree.leaves(state), jax.tree.leaves(back), jax.tree.leaves(template), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.is_equivalent_to(t.sharding, b.ndim)  # placed as the new mesh wants
    w = back["params"]["layers"]["w_gate"]
    assert len(w.sharding.device_set) == (1 if restored is None else 8)


@pytest.mark.slow
def test_checkpoints_move_between_meshes(corpus, single_device_run, tmp_path):
    ref = _losses(single_device_run)
    # saved on 8 devices (2 x 4), resumed on 1
    out = tmp_path / "8to1"
    res = _train(corpus, out, "--set", "mesh.data=2", "--set", "mesh.expert=4", env={"MOELAB_TEST_FAULTS": "kill@15"})
    assert res.returncode == -9
    res = _train(corpus, out, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    np.testing.assert_allclose(_losses(out), ref, rtol=0, atol=1e-4)
    # saved on 1, resumed on 8 (1 x 8)
    out = tmp_path / "1to8"
    res = _train(corpus, out, env={"MOELAB_TEST_FAULTS": "kill@15"})
    assert res.returncode == -9
    res = _train(corpus, out, "--resume", "--set", "mesh.expert=8")
    assert res.returncode == 0, res.stderr[-3000:]
    np.testing.assert_allclose(_losses(out), ref, rtol=0, atol=1e-4)
    from moelab.runs import read_jsonl

    assert any(e["event"] == "mesh_change" for e in read_jsonl(out / "events.jsonl"))


@pytest.mark.parametrize(
    "sets,devices,why",
    [
        (
            ["model.n_routed=8", "mesh.expert=3", "train.batch_size=6"],
            None,
            "mesh.expert: 3 does not divide model.n_routed",
        ),
        (["mesh.expert=4"], None, "there are 8 devices"),
        (["mesh.expert=8", "train.batch_size=4"], None, "train.batch_size: 4 sequences do not split"),
        # settings the transports would not honour: refused, not silently changed
        (
            ["mesh.expert=8", "train.batch_size=8", "model.dispatch=spill"],
            None,
            "model.ep_transport: fixed with model.dispatch=spill",
        ),
        (["mesh.expert=8", "train.batch_size=8", "model.ep_transport=spill"], None, "set model.dispatch=spill"),
        (
            ["mesh.expert=8", "train.batch_size=8", "model.capacity_group=64"],
            None,
            "each device's 32 tokens are one capacity group",
        ),
        (
            ["mesh.expert=8", "train.batch_size=8", "model.ep_transport=pooled_wave", "model.drop_order=score"],
            None,
            "model.drop_order: pooled_wave",
        ),
        (
            ["mesh.expert=8", "train.batch_size=8", "model.dispatch=dropless", "model.ep_transport=pooled_wave"],
            None,
            "dropless exchanges every assignment",
        ),
    ],
)
def test_bad_meshes_are_refused_with_one_line(corpus, tmp_path, sets, devices, why):
    extra = [a for s in sets for a in ("--set", s)]
    res = _train(corpus, tmp_path / "bad", *extra)
    assert res.returncode == 2 and why in res.stderr and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_two_processes_of_four_devices_equal_one_process_of_eight(corpus, ep_run, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:  # a free port for the coordinator
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "moelab", "train", "tiny", "--out", str(out), "--steps", "20", "--quiet",
           "--data", corpus["code"], "--data", corpus["prose"], "--devices", "4", "--set", "mesh.expert=8",
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]  # fmt: skip
    for o in MICRO + ["train.batch_size=8", "model.capacity_factor=4.0", "train.checkpoint_every=10"]:
        cmd += ["--set", o]
    procs = [
        subprocess.Popen(
            cmd + ["--process-id", str(i)],
            cwd=ROOT,
            env=dict(os.environ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    np.testing.assert_allclose(_losses(out), _losses(ep_run), rtol=0, atol=1e-5)
    assert (out / "ckpt" / "step_00000020").exists() and (out / ".process-1").is_dir()  # one writer
    from moelab.runs import read_jsonl

    # each process built only its own half of every batch, and together they are the global batch
    spans = [[e["batch_rows"] for e in read_jsonl(d / "events.jsonl") if e["event"] == "launch"][0]
             for d in (out, out / ".process-1")]  # fmt: skip
    assert spans == [[0, 4], [4, 8]]


@pytest.mark.slow  # 14 s: `make test-all` (CI) runs it; the forward and gradient equivalences stay in make test
def test_ep_with_fsdp_training_equals_one_device_in_a_few_steps(corpus, tmp_path):
    """The default run's version of the slow CLI checks above: three steps in this process (its 8 host
    devices) on one device and on a 4 x 2 mesh (FSDP over data, experts over expert: the all-to-all
    transport and the sharded state at once): the same losses and held-out losses."""
    from moelab.config import load_config
    from moelab.train.loop import train

    sets = [*MICRO, "train.batch_size=8", "model.capacity_factor=4.0", "train.steps=3", "train.eval_every=3",
            "train.checkpoint_every=1000", f"data.sources=[{corpus['code']}, {corpus['prose']}]"]  # fmt: skip
    runs = {}
    for name, mesh in (("one", []), ("fsdp", ["mesh.data=4", "mesh.expert=2"])):
        train(load_config("tiny", sets + mesh), tmp_path / name, progress=False)
        runs[name] = (_losses(tmp_path / name), _evals(tmp_path / name))
        from moelab.runs import read_jsonl

        (launch,) = [e for e in read_jsonl(tmp_path / name / "events.jsonl") if e["event"] == "launch"]
        want = {"one": None, "fsdp": {"data": 4, "expert": 2}}[name]
        assert launch["mesh"] == want, (name, launch["mesh"])  # really on the mesh
    ref_losses, ref_evals = runs.pop("one")
    assert len(ref_losses) == 3
    for name, (losses, evals) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-4, err_msg=name)
        for got, want in zip(evals, ref_evals, strict=True):
            assert got == pytest.approx(want, abs=1e-4), name


@pytest.mark.slow  # 35 s: two jax.distributed processes (the README's multi-process test)
def test_two_processes_equal_one_in_two_steps(corpus, tmp_path):
    """The default run's version of the slow two-process check: two processes of four devices each
    (a coordinator on this machine), two steps, against one process of eight (this one)."""
    import os
    import socket
    import subprocess
    import sys

    from moelab.config import load_config
    from moelab.train.loop import train

    sets = [*MICRO, "train.batch_size=8", "model.capacity_factor=4.0", "train.checkpoint_every=1000",
            "train.eval_every=0", "mesh.expert=8"]  # fmt: skip
    train(load_config("tiny", [*sets, "train.steps=2", f"data.sources=[{corpus['code']}, {corpus['prose']}]"]),
          tmp_path / "one", progress=False)  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "moelab", "train", "tiny", "--out", str(out), "--steps", "2", "--quiet",
           "--data", corpus["code"], "--data", corpus["prose"], "--devices", "4",
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]  # fmt: skip
    for o in sets:
        cmd += ["--set", o]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], cwd=ROOT, env=dict(os.environ), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]  # fmt: skip
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    np.testing.assert_allclose(_losses(out), _losses(tmp_path / "one"), rtol=0, atol=1e-5)
    assert len(_losses(out)) == 2 and (out / ".process-1").is_dir()  # one writer, two processes
