"""Shared test helpers: the reference facts and small configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# eight simulated CPU devices for the expert-parallel tests; set before anything imports JAX. A
# run whose mesh is 1 x 1 ignores the extra devices (and so do the CLI subprocesses, which inherit it).
# The tests' programs are tiny and compiled once each, so LLVM's optimisation of the machine code is
# turned off: compiling dominates them (a fifth less time measured on the model tests); XLA's own
# passes, buffer assignment included, run as in a real run. Set MOELAB_TEST_XLA_OPT=1 to keep them.
_OPT = "" if os.environ.get("MOELAB_TEST_XLA_OPT") else " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _OPT).strip()

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_REFERENCE = ROOT.parent / "shared" / "reference" / "marin_hero.json"
PACKAGE_REFERENCE = ROOT / "src" / "moelab" / "reference" / "marin_hero.json"


@pytest.fixture(scope="session")
def marin() -> dict:
    """Marin's published facts: the project's shared/ copy, else the copy shipped in the package."""
    path = SHARED_REFERENCE if SHARED_REFERENCE.exists() else PACKAGE_REFERENCE
    return json.loads(path.read_text())


def random_batch(cfg, seed: int):
    """A [batch_size, seq_len + 1] batch of random token ids for ``cfg``, from ``seed``."""
    import jax
    import numpy as np

    shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
    return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), shape, 0, cfg.model.vocab_size), np.int32)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moelab", *args], capture_output=True, text=True, cwd=ROOT)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Token stores built by tests go to a temporary cache, shared by the session."""
    import os

    os.environ["MOELAB_CACHE"] = str(tmp_path_factory.mktemp("moelab_cache"))
    yield


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """Two small domains made from the standard library: a directory of code and a jsonl of prose."""
    import sysconfig
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("corpus")
    code = root / "code"
    code.mkdir()
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap", "fnmatch", "glob", "bisect", "heapq", "colorsys", "shlex", "string", "queue", "sched"):
        (code / f"{name}.py").write_text((lib / f"{name}.py").read_text())
    prose = root / "prose.jsonl"
    with open(prose, "w") as fh:
        for key in sorted(topics)[:60]:
            fh.write(json.dumps({"text": topics[key], "topic": key}) + "\n")
    return {"root": root, "code": str(code), "prose": str(prose)}


@pytest.fixture(scope="session")
def tiny_run(corpus, tmp_path_factory) -> Path:
    """A trained run of the tiny preset at MICRO size (sigmoid router with its bias, latent experts,
    local and global layers), context 64, 10 steps: for sampling, the export and lm-eval."""
    from moelab.config import load_config
    from moelab.train.loop import train

    out = tmp_path_factory.mktemp("tiny") / "run"
    cfg = load_config("tiny", [*MICRO, "model.seq_len=64", f"data.sources=[{corpus['code']}, {corpus['prose']}]",
                               "train.steps=10", "train.eval_every=10"])  # fmt: skip
    train(cfg, out, progress=False)
    return out


# `make test-ragged` sets MOELAB_TEST_MOE_IMPL=ragged: the model and training tests then build their
# models with that model.moe_impl (ragged_dot, the GPU and TPU default, run here on CPU)
MOE_IMPL = os.environ.get("MOELAB_TEST_MOE_IMPL", "")
MOE_SET = [f"model.moe_impl={MOE_IMPL}"] if MOE_IMPL else []

# a model small enough that a subprocess run of 30 steps takes seconds
MICRO = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.n_kv_heads_local=2",
    "model.seq_len=32", "model.sliding_window=16", "model.vocab_size=512", "model.expert_dim=32",
    "model.latent_dim=32", "model.shared_dim=32", "train.batch_size=4", "train.log_every=1",
    "train.eval_tokens=256", "train.checkpoint_every=10", "train.peak_flops=1e11",
] + MOE_SET  # fmt: skip


# an experiment file whose steps count their runs in COUNTS and can be made to fail or hang
EXPERIMENT = """
import os, time
from pathlib import Path
from moelab.lab import Experiment, Prediction, Step, output_of, versioned

COUNTS = Path(os.environ["LAB_COUNTS"])

def work(cfg, out):
    with open(COUNTS / cfg["name"], "a") as fh:
        fh.write("ran\\n")
    if os.environ.get("LAB_FAIL") == cfg["name"]:
        raise RuntimeError("boom in " + cfg["name"])
    hang = COUNTS / ("hang-" + cfg["name"])
    if os.environ.get("LAB_HANG") == cfg["name"] and not hang.exists():
        hang.write_text("started")
        time.sleep(120)
    time.sleep(float(os.environ.get("LAB_SLEEP", "0")))
    (out / "result.txt").write_text(cfg["name"])
    upstream = cfg.get("input")
    return {"value": 2.0 + (len(Path(upstream, "result.txt").read_text()) if upstream else 0)}

a = Step("a", work, {"name": "a", "size": versioned(VALUE)})
b = Step("b", work, {"name": "b", "input": output_of(a)})
c = Step("c", work, {"name": "c", "input": output_of(b)})
experiment = Experiment(issue=9, slug="chain", title="TITLE", goal="g", hypothesis=HYPOTHESIS,
    prediction=Prediction(metric="c:value", value=3.0, low=2.9, high=3.1), steps=[c])
"""


def write_experiment(path: Path, value=1, hypothesis="h", title="a chain") -> Path:
    text = EXPERIMENT.replace("VALUE", repr(value)).replace("HYPOTHESIS", repr(hypothesis)).replace("TITLE", title)
    path.write_text(text)
    return path


@pytest.fixture
def lab(tmp_path, monkeypatch):
    counts = tmp_path / "counts"
    counts.mkdir()
    monkeypatch.setenv("LAB_COUNTS", str(counts))
    monkeypatch.setenv("MOELAB_LEASE_TIMEOUT", "2")
    return {"counts": counts, "prefix": tmp_path / "prefix", "exp": write_experiment(tmp_path / "exp9_chain.py")}
