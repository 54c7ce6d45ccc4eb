"""The speed work's invariants: huge pages for the step's buffers, and the CLI restarting with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moelab._alloc import KEEP, TUNABLE, hugepage_env

# a jitted function with two 64 MiB temporaries, which XLA:CPU allocates on every call
FAULTS = """
import json, resource
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.sin(x) * jnp.cos(x)[::-1]))
x = jnp.ones((4096, 4096), jnp.float32)
for _ in range(3):
    f(x).block_until_ready()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    f(x).block_until_ready()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5))
"""

needs_thp = pytest.mark.skipif(
    hugepage_env({}) is None, reason="needs Linux, glibc and transparent huge pages (madvise or always)"
)


def faults_per_call(tunables: str) -> float:
    env = dict(os.environ, GLIBC_TUNABLES=tunables, XLA_FLAGS="")
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_thp
@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_huge_pages_remove_most_per_call_page_faults():
    """128 MiB of temporaries is 32,768 fresh 4 KiB pages per call by default, 64 huge pages with the tunable,
    and none once the heap keeps what is freed (MOELAB_MALLOC=keep)."""
    default, huge = faults_per_call(""), faults_per_call(TUNABLE)
    assert default > 16_000  # at least half the temporaries' pages faulted in again on every call
    assert huge < default / 20
    assert faults_per_call(":".join((TUNABLE, *KEEP))) < huge / 4  # measured: 1-40 against 580


def test_restart_environment():
    """The tunable is added to what is there, once; MOELAB_MALLOC=system leaves everything alone."""
    assert hugepage_env({"MOELAB_MALLOC": "system"}) is None
    assert hugepage_env({"GLIBC_TUNABLES": TUNABLE}) is None
    env = hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    if env is not None:  # on a machine that has transparent huge pages
        assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"
        assert hugepage_env(env) is None
        keep = hugepage_env({"MOELAB_MALLOC": "keep"})
        assert keep["GLIBC_TUNABLES"].split(":") == [TUNABLE, *KEEP] and hugepage_env(keep) is None
    with pytest.raises(SystemExit, match="MOELAB_MALLOC='fast': give one of hugepages, keep, system"):
        hugepage_env({"MOELAB_MALLOC": "fast"})


def _loss_and_grads(cfg, key=0):
    import jax
    import numpy as np

    from moelab.model import init_params, init_state, loss_fn

    m = cfg.model
    params = init_params(m, jax.random.PRNGKey(key))
    tokens = np.random.default_rng(key).integers(0, m.vocab_size, (cfg.train.batch_size, m.seq_len + 1))
    fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (metrics, state)), grads = jax.jit(fn, static_argnums=4)(
        params, init_state(m), tokens[:, :-1], tokens[:, 1:], m
    )
    return loss, metrics, state, grads


@pytest.mark.parametrize(
    "shape,options",
    [
        # remat: a scan over 2 local/global periods, then the last layer unrolled; 3 chunks of the
        # 4 x 32 = 128 tokens, the last padded
        (["model.n_layers=5"], ["model.remat=layer", "model.ce_chunk=48"]),
        pytest.param([], ["model.ce_chunk=48"], marks=pytest.mark.slow),  # the chunks alone; the case above has them
    ],
)
def test_memory_options_equal_the_reference_step(shape, options):
    """Rematerialisation and the chunked cross-entropy change memory, not numbers: loss, metrics, grads."""
    import jax
    import numpy as np

    from moelab.config import load_config

    base = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.vocab_size=96",
            "model.seq_len=32", "model.sliding_window=16", "model.n_routed=4", "model.expert_dim=16", "model.latent_dim=16",
            "model.shared_dim=16", "train.batch_size=4"]  # fmt: skip
    ref = _loss_and_grads(load_config("tiny", base + shape))
    fast = _loss_and_grads(load_config("tiny", base + shape + options))
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_chunked_cross_entropy_never_holds_the_whole_logits():
    """XLA's own accounting: the step's temporaries shrink by about the [tokens, vocab] logits."""
    import jax
    import numpy as np

    from moelab.config import load_config
    from moelab.model import init_params, init_state, loss_fn

    def temp_bytes(chunk):
        cfg = load_config("tiny", ["model.n_layers=1", "model.vocab_size=8192", "train.batch_size=4",
                                   f"model.ce_chunk={chunk}"])  # fmt: skip
        m = cfg.model
        params = init_params(m, jax.random.PRNGKey(0))
        tokens = np.zeros((4, m.seq_len + 1), np.int32)
        grad = jax.jit(jax.grad(lambda p: loss_fn(p, init_state(m), tokens[:, :-1], tokens[:, 1:], m)[0]))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    logits = 4 * 128 * 8192 * 4  # tokens x vocab in fp32: 16 MiB
    whole, chunked = temp_bytes(0), temp_bytes(64)
    assert whole - chunked > logits  # the logits and their gradient are gone


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_layer_remat_shrinks_the_step_buffer():
    """XLA's own accounting: with remat=layer the step keeps about one layer's activations, not all."""
    import jax
    import numpy as np

    from moelab.config import load_config
    from moelab.model import init_params, init_state, loss_fn

    def temp_bytes(remat):
        cfg = load_config("tiny", ["model.n_layers=4", f"model.remat={remat}"])
        m = cfg.model
        params = init_params(m, jax.random.PRNGKey(0))
        tokens = np.zeros((cfg.train.batch_size, m.seq_len + 1), np.int32)
        grad = jax.jit(jax.grad(lambda p: loss_fn(p, init_state(m), tokens[:, :-1], tokens[:, 1:], m)[0]))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("layer") < 0.6 * temp_bytes("none")
