"""The speed work's invariants: huge pages for the step's buffers, and the CLI restarting with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import run_cli
from moelab._alloc import TUNABLE, hugepage_env

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
def test_huge_pages_remove_most_per_call_page_faults():
    """128 MiB of temporaries is 32,768 fresh 4 KiB pages per call by default, 64 huge pages with the tunable."""
    default, huge = faults_per_call(""), faults_per_call(TUNABLE)
    assert default > 16_000  # at least half the temporaries' pages faulted in again on every call
    assert huge < default / 20


def test_restart_environment():
    """The tunable is added to what is there, once; MOELAB_MALLOC=system leaves everything alone."""
    assert hugepage_env({"MOELAB_MALLOC": "system"}) is None
    assert hugepage_env({"GLIBC_TUNABLES": TUNABLE}) is None
    env = hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    if env is not None:  # on a machine that has transparent huge pages
        assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"
        assert hugepage_env(env) is None


@needs_thp
def test_the_command_runs_with_huge_pages():
    tiny = "--d-model 32 --layers 1 --heads 2 --experts 4 --top-k 2 --expert-dim 16 --shared-dim 32 --seq 16 --batch 2 --vocab 64"
    res = run_cli("bench", "train-step", *tiny.split(), "--steps", "2", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["hugepages"] is True
