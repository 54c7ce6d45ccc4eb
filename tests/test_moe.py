"""The MoE block against slow references and hand-worked cases: dropless, capacity, spill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import config_from_dict
from moelab.model import router as rt
from moelab.model.moe import (
    LOOP_MIN_EXPERTS,
    block_plan,
    cover_plan,
    cover_sizes,
    dropless,
    dropless_blocks,
    dropless_gathered,
    dropless_loop,
    dropless_ragged,
    moe_block,
    place_capacity,
    place_spill,
    routed_experts,
)
from moelab.model.transformer import init_params
from reference import moe_reference, reference_choices


def small(**model) -> tuple:
    base = dict(
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        n_routed=4,
        top_k=2,
        expert_dim=8,
        n_shared=1,
        shared_dim=12,
        latent_dim=0,
        vocab_size=32,
        seq_len=6,
    )
    base.update(model)
    m = config_from_dict({"model": base, "train": {"batch_size": 2}}).model
    params = init_params(m, jax.random.PRNGKey(0))
    layer = jax.tree.map(lambda a: a[0], params["layers"])
    # a router with some spread, so top-k choices are far from ties
    layer["router"] = layer["router"] * 3.0
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, m.d_model))
    bias = 0.3 * jax.random.normal(jax.random.PRNGKey(2), (m.n_routed,))
    return m, layer, x, bias


CASES = [
    dict(latent_dim=0, n_shared=0),
    dict(latent_dim=0, n_shared=1),
    dict(latent_dim=8, n_shared=0),
    dict(latent_dim=8, n_shared=2, router="sigmoid", routed_scale=2.5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_dropless_equals_loop_reference_forward_and_grad(case):
    m, p, x, bias = small(**case)
    y = moe_block(p, x, bias, m, "dropless")[0]
    y_ref = moe_reference(p, x, bias, m)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)

    probe = jax.random.normal(jax.random.PRNGKey(3), y.shape)
    fast = jax.grad(lambda p, x: jnp.sum(moe_block(p, x, bias, m, "dropless")[0] * probe), argnums=(0, 1))(p, x)
    choices = reference_choices(p, x, bias, m)
    slow = jax.grad(lambda p, x: jnp.sum(moe_reference(p, x, bias, m, choices=choices) * probe), argnums=(0, 1))(p, x)
    for name in p:
        np.testing.assert_allclose(fast[0][name], slow[0][name], atol=1e-5, rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(fast[1], slow[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dispatch", ["capacity", "spill"])
@pytest.mark.parametrize("order", ["position", "score"])
def test_ample_capacity_equals_dropless(dispatch, order):
    m, p, x, bias = small(latent_dim=8, capacity_factor=4.0, drop_order=order)  # 4 * T * k / E = 2T slots: room for all
    y, metrics, _ = moe_block(p, x, bias, m, dispatch)
    y_ref, _, _ = moe_block(p, x, bias, m, "dropless")
    assert float(metrics["dropped_frac"]) == 0.0
    assert float(metrics["spilled_frac"]) == 0.0
    np.testing.assert_allclose(y, y_ref, atol=1e-6, rtol=1e-6)
    g = jax.grad(lambda p: jnp.sum(moe_block(p, x, bias, m, dispatch)[0] ** 2))(p)
    g_ref = jax.grad(lambda p: jnp.sum(moe_block(p, x, bias, m, "dropless")[0] ** 2))(p)
    for name in p:
        np.testing.assert_allclose(g[name], g_ref[name], atol=1e-6, rtol=1e-5, err_msg=name)


# Four tokens, three experts, top-2, softmax router. Worked by hand:
#   t0 [3, 2, 0] -> experts 0, 1      t1 [2.5, 0, 1] -> 0, 2
#   t2 [4, 1, 0] -> 0, 1              t3 [2, 4, 0]   -> 1, 0
# With capacity 2 per expert:
#   by position: expert 0 serves t0, t1 (drops t2 slot 0, t3 slot 1); expert 1 serves t0, t2
#   (drops t3 slot 0); expert 2 serves t1.
#   by score (softmax probability of the chosen expert): expert 0 sees t2 .936, t1 .766,
#   t0 .705, t3 .117 -> keeps t2, t1; expert 1 sees t3 .867, t0 .259, t2 .047 -> keeps t3, t0.
HAND_LOGITS = jnp.array([[3.0, 2.0, 0.0], [2.5, 0.0, 1.0], [4.0, 1.0, 0.0], [2.0, 4.0, 0.0]])


def hand_routing(router="softmax"):
    m = config_from_dict({"model": {"n_routed": 3, "top_k": 2, "router": router, "n_kv_heads": 1}}).model
    return rt.route(HAND_LOGITS, jnp.zeros(3), m)


def test_capacity_drops_by_position_hand_case():
    r = hand_routing()
    assert r.idx.tolist() == [[0, 1], [0, 2], [0, 1], [1, 0]]
    p = place_capacity(r, capacity=2, drop_order="position")
    assert p.kept.tolist() == [[True, True], [True, True], [False, True], [False, False]]


def test_capacity_drops_by_score_hand_case():
    p = place_capacity(hand_routing(), capacity=2, drop_order="score")
    assert p.kept.tolist() == [[False, True], [True, True], [True, False], [True, False]]


def test_capacity_output_leaves_out_exactly_the_dropped():
    m, p, x, bias = small(n_routed=4, top_k=2, capacity_factor=0.5, drop_order="position")
    y, metrics, _ = moe_block(p, x, bias, m, "capacity")
    # recompute which assignments fit, by hand: token-major order, C = ceil(0.5 * 12 * 2 / 4) = 3
    xt = x.reshape(-1, m.d_model)
    choices = np.argsort(-(np.asarray(xt @ p["router"]) + np.asarray(bias)), axis=1, kind="stable")[:, :2]
    seen = {e: 0 for e in range(4)}
    keep = {}
    for t in range(xt.shape[0]):
        for j, e in enumerate(choices[t]):
            keep[(t, j)] = seen[e] < 3
            seen[e] += 1
    assert float(metrics["dropped_frac"]) == pytest.approx(1 - sum(keep.values()) / len(keep))
    assert float(metrics["dropped_frac"]) > 0
    np.testing.assert_allclose(y, moe_reference(p, x, bias, m, keep=keep), atol=1e-5, rtol=1e-5)


def test_spill_hand_case():
    r = hand_routing()
    p = place_spill(r, capacity=2, drop_order="position")
    # t2's slot 0 overflowed at expert 0; its next choice, expert 2, has room (t1 holds one slot).
    # t3 overflowed twice; its only other expert, 2, is full once t2 is placed -> both dropped.
    assert p.expert.tolist() == [[0, 1], [0, 2], [2, 1], [1, 0]]
    assert p.kept.tolist() == [[True, True], [True, True], [True, True], [False, False]]
    assert p.spilled.tolist() == [[False, False], [False, False], [True, False], [False, False]]
    probs = jax.nn.softmax(HAND_LOGITS[2])
    assert float(p.gates[2, 0]) == pytest.approx(float(probs[2] / (probs[0] + probs[1])), rel=1e-6)


def test_spill_tries_at_most_spill_choices_next_experts():
    """Every token prefers expert 0, then 1, 2, ...: one slot each. Token j lands on expert j when
    it may look j places past its first choice; with 2 choices the fourth token finds 1 and 2 full."""
    logits = jnp.array([[8.0, 7.0, 6.0, 5.0, 4.0, 3.0]] * 4) - 0.01 * jnp.arange(4)[:, None]

    def placed(choices):
        m = config_from_dict({"model": {"n_routed": 6, "top_k": 1, "n_kv_heads": 1, "spill_choices": choices}}).model
        r = rt.route(logits, jnp.zeros(6), m)
        assert r.order.shape == (4, min(6, 1 + choices) if choices else 6)
        return place_spill(r, capacity=1, drop_order="position")

    p = placed(0)  # all next choices
    assert p.expert[:, 0].tolist() == [0, 1, 2, 3] and bool(p.kept.all())
    p = placed(3)
    assert p.expert[:, 0].tolist() == [0, 1, 2, 3] and bool(p.kept.all())
    p = placed(2)
    assert p.kept[:, 0].tolist() == [True, True, True, False]


def test_routing_takes_the_top_choices_without_sorting_every_expert():
    m = config_from_dict({"model": {"n_routed": 64, "top_k": 4, "n_kv_heads": 1, "spill_choices": 8}}).model
    logits = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
    bias = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (64,))
    jaxpr = str(jax.make_jaxpr(lambda x, b: rt.route(x, b, m))(logits, bias))
    assert " top_k[" in jaxpr and " sort[" not in jaxpr  # the primitives, not words in parameters
    r = rt.route(logits, bias, m)
    ref = np.argsort(-(np.asarray(logits) + np.asarray(bias)), axis=1, kind="stable")
    assert r.order.shape == (32, 12)
    np.testing.assert_array_equal(np.asarray(r.order), ref[:, :12])


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_spill_reports_fraction_and_never_drops_with_room():
    m, p, x, bias = small(n_routed=8, top_k=2, capacity_factor=0.75)
    xt = jax.random.normal(jax.random.PRNGKey(5), (64, m.d_model))
    logits = xt @ p["router"] + jnp.linspace(0, 2, 8)  # skewed: the last experts overflow
    r = rt.route(logits, jnp.zeros(8), m)
    cap = m.capacity(64)
    pl = place_spill(r, cap, "position")
    kept = np.asarray(pl.kept)
    expert = np.asarray(pl.expert)
    used = np.bincount(expert[kept], minlength=8)
    assert used.max() <= cap
    spilled_frac = np.asarray(pl.spilled).mean()
    assert spilled_frac > 0
    for t in range(64):
        if kept[t].all():
            continue
        mine = set(expert[t][kept[t]].tolist())
        for e in range(8):
            if e not in mine:
                assert used[e] == cap, f"token {t} dropped while expert {e} had room"
    w = {k: p[k] for k in ("w_gate", "w_up", "w_down")}
    _, stats = routed_experts(xt, r, w, m.__class__(**{**m.__dict__, "capacity_factor": 0.75}), "spill")
    assert float(stats["spilled_frac"]) == pytest.approx(spilled_frac)
    assert float(stats["dropped_frac"]) == pytest.approx(1 - kept.mean())
    # spill drops fewer than plain capacity on the same routing
    assert float(stats["dropped_frac"]) < 1 - np.asarray(place_capacity(r, cap, "position").kept).mean()


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_capacity_groups_count_per_group():
    m, p, x, bias = small(capacity_factor=1.0, capacity_group=6)
    _, metrics, _ = moe_block(p, x, bias, m, "capacity")
    # one group per sequence: the same as running each sequence alone
    per_seq = [
        moe_block(p, x[i : i + 1], bias, m.__class__(**{**m.__dict__, "capacity_group": 0}), "capacity")
        for i in range(2)
    ]
    assert float(metrics["dropped_frac"]) == pytest.approx(np.mean([float(o[1]["dropped_frac"]) for o in per_seq]))
    y_groups = moe_block(p, x, bias, m, "capacity")[0]
    np.testing.assert_allclose(y_groups, jnp.concatenate([o[0] for o in per_seq]), atol=1e-6)


def skewed_logits(key, t=16384, e=16):
    offsets = jnp.linspace(0.0, 4.0, e)  # the last expert is e^4 ~ 55x likelier than the first
    scale = jnp.linspace(0.5, 2.0, e)[::-1]
    return jax.random.normal(key, (t, e)) * scale + offsets


def max_mean(idx, e):
    load = np.bincount(np.asarray(idx).ravel(), minlength=e)
    return load.max() / load.mean()


@pytest.mark.parametrize("n,e,q", [(1000, 8, 0.75), (2048, 64, 1 - 8 / 64), (7, 3, 0.5), (2, 4, 0.9), (1, 2, 0.5)])
def test_column_quantile_from_counts_equals_jnp_quantile(n, e, q):
    x = jax.random.normal(jax.random.PRNGKey(n), (n, e)) * 3.0
    x = x.at[::5, 0].set(0.5)  # ties
    x = x.at[:, 1].set(-2.0)  # a constant column
    x = x.at[0, -1].set(-0.0)  # a negative zero
    np.testing.assert_allclose(rt.column_quantile(x, q), jnp.quantile(x, q, axis=0), rtol=0, atol=1e-6)


def test_quantile_bias_balances_a_skewed_router():
    m = config_from_dict({"model": {"n_routed": 16, "top_k": 2, "router": "sigmoid", "bias_update": "quantile"}}).model
    bias = jnp.zeros(16)
    frozen, balanced = [], []
    for i in range(5):
        logits = skewed_logits(jax.random.PRNGKey(i))
        frozen.append(max_mean(rt.route(logits, jnp.zeros(16), m).idx, 16))
        r = rt.route(logits, bias, m)
        balanced.append(max_mean(r.idx, 16))
        bias = rt.next_bias(r, bias, m)  # applied on the next batch, a fresh one
    assert min(frozen) > 2.0
    assert balanced[0] == frozen[0]
    # 2048 assignments per expert on average: sampling noise alone puts max/mean near 1.05
    assert max(balanced[2:]) < 1.1, balanced
    assert abs(float(jnp.mean(bias))) < 1e-5  # mean-centred


def test_sign_bias_moves_load_the_right_way():
    m = config_from_dict(
        {"model": {"n_routed": 16, "top_k": 2, "router": "sigmoid", "bias_update": "sign", "bias_rate": 0.05}}
    ).model
    logits = skewed_logits(jax.random.PRNGKey(0))
    bias = jnp.zeros(16)
    r = rt.route(logits, bias, m)
    load = np.bincount(np.asarray(r.idx).ravel(), minlength=16)
    new = np.asarray(rt.next_bias(r, bias, m))
    over, under = load > load.mean(), load < load.mean()
    assert (new[over] == -0.05).all() and (new[under] == 0.05).all()
    first = max_mean(r.idx, 16)
    for _ in range(60):
        r = rt.route(logits, bias, m)
        bias = rt.next_bias(r, bias, m)
    assert max_mean(rt.route(logits, bias, m).idx, 16) < first / 2


def test_bias_changes_selection_not_gates():
    m = config_from_dict({"model": {"n_routed": 3, "top_k": 1, "router": "sigmoid", "routed_scale": 2.0}}).model
    logits = jnp.array([[1.0, 0.5, 0.0]])
    r = rt.route(logits, jnp.array([0.0, 1.0, 0.0]), m)
    assert r.idx.tolist() == [[1]]
    assert float(r.gates[0, 0]) == pytest.approx(2.0)  # renormalised to routed_scale
    # top-2: the gates are the unbiased sigmoid scores of the chosen experts, renormalised
    m2 = config_from_dict({"model": {"n_routed": 3, "top_k": 2, "router": "sigmoid", "routed_scale": 2.0}}).model
    r2 = rt.route(logits, jnp.array([0.0, 0.0, 5.0]), m2)
    assert r2.idx.tolist() == [[2, 0]]
    s = jax.nn.sigmoid(logits[0])
    np.testing.assert_allclose(r2.gates[0], 2.0 * np.array([s[2], s[0]]) / (s[2] + s[0]), rtol=1e-6)


def test_switch_aux_loss_hand_case():
    # probabilities [.8, .2] and [.6, .4], top-1 -> both tokens to expert 0:
    # f = [1, 0], P = [.7, .3], aux = E * sum f P = 2 * .7 = 1.4
    probs = jnp.array([[0.8, 0.2], [0.6, 0.4]])
    m = config_from_dict({"model": {"n_routed": 2, "top_k": 1, "n_kv_heads": 1}}).model
    r = rt.route(jnp.log(probs), jnp.zeros(2), m)
    assert float(rt.switch_aux_loss(r.log_scores, r.idx, 2)) == pytest.approx(1.4, rel=1e-6)
    # perfectly balanced uniform router -> 1.0
    r = rt.route(jnp.zeros((4, 2)) + jnp.array([[1e-3, 0], [0, 1e-3], [1e-3, 0], [0, 1e-3]]), jnp.zeros(2), m)
    assert float(rt.switch_aux_loss(r.log_scores, r.idx, 2)) == pytest.approx(1.0, rel=1e-3)


def test_router_metrics_hand_case():
    logits = jnp.array([[0.0, 0.0], [2.0, 0.0]])
    lse = np.log([2.0, np.exp(2.0) + 1.0])
    assert float(rt.router_z_loss(logits)) == pytest.approx(float(np.mean(lse**2)), rel=1e-6)
    uniform = rt.router_entropy(jax.nn.log_softmax(jnp.zeros((3, 8))))
    assert float(uniform) == pytest.approx(1.0, rel=1e-6)
    peaked = rt.router_entropy(jnp.log(jnp.array([[1.0, 0.0, 0.0, 0.0]])))
    assert float(peaked) == pytest.approx(0.0, abs=1e-6)
    # two of four equally likely: entropy log 2 of log 4
    half = rt.router_entropy(jnp.log(jnp.array([[0.5, 0.5, 0.0, 0.0]])))
    assert float(half) == pytest.approx(0.5, rel=1e-6)


@pytest.mark.parametrize("e,f,path", [(8, 10, "blocks"), (LOOP_MIN_EXPERTS, 10, "loop"), (8, 136, "loop")])
def test_auto_takes_the_loop_for_large_experts_or_many_small_ones_on_cpu(e, f, path):
    """model.moe_impl auto on CPU: the loop from 128 x 128 experts or from LOOP_MIN_EXPERTS experts
    (the batched blocks pad a block per expert and gather a weight copy per block), blocks below."""
    key = jax.random.split(jax.random.PRNGKey(3), 6)
    t, k, din = 64, 2, 128
    h = jax.random.normal(key[0], (t, din))
    idx = jax.lax.top_k(jax.random.normal(key[1], (t, e)), k)[1]
    gates = jax.nn.softmax(jax.random.normal(key[2], (t, k)))
    w = {"w_gate": jax.random.normal(key[3], (e, din, f)) / 8, "w_up": jax.random.normal(key[4], (e, din, f)) / 8,
         "w_down": jax.random.normal(key[5], (e, f, din)) / 8}  # fmt: skip
    got = np.asarray(jax.jit(lambda h, w: dropless(h, idx, gates, w))(h, w))
    want = {p: np.asarray(jax.jit(lambda h, w, p=p: dropless(h, idx, gates, w, p))(h, w)) for p in ("blocks", "loop")}
    assert not np.array_equal(want["blocks"], want["loop"])  # the two paths round differently: tells them apart
    assert np.array_equal(got, want[path])


@pytest.mark.parametrize(
    "skew,fast",
    [
        (0.0, dropless_blocks),
        (3.0, dropless_blocks),
        (0.0, dropless_loop),
        (50.0, dropless_loop),
        (3.0, dropless_gathered),
    ],
)
def test_block_dropless_equals_ragged_dot_path(skew, fast):
    """The CPU fast paths against the ragged_dot reference, with empty and crowded experts.

    skew 50 sends every token to the same k experts: most blocks are padding, which the loop skips.
    """
    key = jax.random.split(jax.random.PRNGKey(7), 6)
    t, k, e, din, f = 50, 3, 8, 12, 10
    h = jax.random.normal(key[0], (t, din))
    logits = jax.random.normal(key[1], (t, e)) + skew * jnp.arange(e) / e
    idx = jax.lax.top_k(logits, k)[1]
    gates = jax.nn.softmax(jax.random.normal(key[2], (t, k)))
    w = {
        "w_gate": jax.random.normal(key[3], (e, din, f)) / 4,
        "w_up": jax.random.normal(key[4], (e, din, f)) / 4,
        "w_down": jax.random.normal(key[5], (e, f, din)) / 4,
    }
    np.testing.assert_allclose(fast(h, idx, gates, w), dropless_ragged(h, idx, gates, w), atol=1e-5)
    grad = lambda fn: jax.grad(lambda h, g, w: jnp.sum(fn(h, idx, g, w) ** 2), argnums=(0, 1, 2))(h, gates, w)  # noqa: E731
    for a, b in zip(jax.tree.leaves(grad(fast)), jax.tree.leaves(grad(dropless_ragged)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


def test_block_plan_hand_case():
    """4 tokens top-1 over 3 experts in blocks of 2: expert 0 has 3 rows (2 blocks), 1 none, 2 one."""
    idx = jnp.array([[2], [0], [0], [0]])
    plan = block_plan(idx, 3, 2)
    # bound: 4/2 + 3 = 5 blocks; used: 2 for expert 0, 1 for expert 2
    assert plan.src.shape == (5, 2) and int(plan.n_used) == 3
    np.testing.assert_array_equal(plan.src, [[1, 2], [3, 4], [0, 4], [4, 4], [4, 4]])  # 4 = padding
    np.testing.assert_array_equal(plan.block_expert[:3], [0, 0, 2])
    np.testing.assert_array_equal(plan.row, [4, 0, 1, 2])


def test_cover_plan_hand_case_and_invariants():
    """Blocks of 64/32/16/8 rows: an expert of 70 rows gets 64 + 8, one of 40 gets 32 + 8 (cost 40 + 2
    overheads of 64/6 beats 64 + 1), one of 100 gets 64 + 32 + 8 (104 rows); none for an empty one."""
    sizes = (64, 32, 16, 8)
    idx = jnp.asarray([0] * 70 + [2] * 40 + [3] * 100, jnp.int32)[:, None]
    plan = cover_plan(idx, 4, sizes)
    assert [int(c) for c in plan.counts] == [2, 2, 0, 3]
    got = {(int(e), z) for c, z in enumerate(sizes) for e in np.asarray(plan.experts[c])[: int(plan.counts[c])]}
    assert got == {(0, 64), (0, 8), (2, 32), (2, 8), (3, 64), (3, 32), (3, 8)}
    # random loads, balanced to very skewed: every assignment has its own row, inside a block of its
    # expert; blocks do not overlap; each expert's padding is less than the largest block
    for seed, skew in [(0, 0.0), (1, 2.0), (2, 20.0)]:
        rng = np.random.default_rng(seed)
        t, k, e = 300, 3, 6
        logits = rng.normal(size=(t, e)) + skew * np.linspace(-1, 1, e)
        idx = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
        sizes = cover_sizes(t * k, e)
        plan = cover_plan(jnp.asarray(idx), e, sizes)
        owner = np.full(plan.src.shape[0], -1)
        for c, z in enumerate(sizes):
            for off, ex in zip(
                np.asarray(plan.offsets[c])[: int(plan.counts[c])], np.asarray(plan.experts[c]), strict=False
            ):
                assert np.all(owner[off : off + z] == -1)
                owner[off : off + z] = ex
        row = np.asarray(plan.row)
        assert len(set(row.tolist())) == t * k
        np.testing.assert_array_equal(owner[row], idx.reshape(-1))
        np.testing.assert_array_equal(np.asarray(plan.src)[row], np.arange(t * k) // k)
        load = np.bincount(idx.reshape(-1), minlength=e)
        covered = np.bincount(owner[owner >= 0], minlength=e)
        assert np.all(covered >= load) and np.all(covered - load < sizes[0])


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_loop_dropless_in_bf16_tracks_fp32():
    """The loop path in bf16: forward and gradients within bf16 rounding of the fp32 ones."""
    key = jax.random.split(jax.random.PRNGKey(3), 6)
    t, k, e, din, f = 64, 2, 4, 16, 8
    h = jax.random.normal(key[0], (t, din))
    idx = jax.lax.top_k(jax.random.normal(key[1], (t, e)), k)[1]
    gates = jax.nn.softmax(jax.random.normal(key[2], (t, k)))
    shapes = {"w_gate": (e, din, f), "w_up": (e, din, f), "w_down": (e, f, din)}
    w = {n: jax.random.normal(kk, s) / 4 for (n, s), kk in zip(shapes.items(), key[3:], strict=True)}

    def run(h, w):
        loss = lambda h, w: jnp.sum(dropless_loop(h, idx, gates, w).astype(jnp.float32) ** 2)  # noqa: E731
        return dropless_loop(h, idx, gates, w), jax.grad(loss, argnums=(0, 1))(h, w)

    low = run(*jax.tree.map(lambda a: a.astype(jnp.bfloat16), (h, w)))
    high = run(h, w)
    for a, b in zip(jax.tree.leaves(low), jax.tree.leaves(high), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=0.02 * float(jnp.max(jnp.abs(b))))
