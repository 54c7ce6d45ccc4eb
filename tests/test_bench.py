"""`moelab bench train-step`: the JSON has every field with a sane value, on a tiny shape."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from moelab import accounting
from moelab._alloc import hugepage_env
from moelab.bench import shape_config

TINY = ["--d-model", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--experts", "8", "--top-k", "2",
        "--expert-dim", "32", "--shared", "1", "--shared-dim", "64", "--seq", "32", "--batch", "4", "--vocab", "256"]  # fmt: skip


@pytest.mark.slow  # over 10 s: `make test-all` (CI) runs it; make test measured 16:24 with it
def test_train_step_bench_json_has_every_field():
    res = run_cli("bench", "train-step", *TINY, "--steps", "4", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout)
    cfg = shape_config(d_model=64, layers=2, heads=4, kv_heads=2, experts=8, top_k=2, expert_dim=32, shared=1,
                       shared_dim=64, seq=32, batch=4, vocab=256)  # fmt: skip
    count = accounting.count(cfg)
    assert r["shape"]["d_model"] == 64 and r["shape"]["experts"] == 8 and r["tokens_per_step"] == 128
    assert r["model_flops_per_token"] == pytest.approx(3 * count.forward_flops_per_token)
    assert r["params"] == count.total_params
    assert r["step_time_p10_s"] <= r["step_time_median_s"] <= r["step_time_p90_s"]
    assert r["tokens_per_s"] == pytest.approx(128 / r["step_time_median_s"])
    assert r["achieved_flops_per_s"] == pytest.approx(r["tokens_per_s"] * r["model_flops_per_token"])
    assert r["mfu"] == pytest.approx(r["achieved_flops_per_s"] / r["matmul_peak_flops_per_s"])
    assert r["matmul_peak_flops_per_s"] > 1e8 and r["compute_dtype"] == "float32"
    assert 0 < r["compile_s"] < 120
    # the state is the parameters and AdamW's two moments in fp32 (and the router biases)
    assert 3 * 4 * r["params"] <= r["state_bytes"] < 3 * 4 * r["params"] + 4096
    assert r["memory_estimate_bytes"] == r["state_bytes"] + r["xla_temp_bytes"] and r["xla_temp_bytes"] > 0
    assert r["peak_rss_bytes"] >= r["peak_rss_steps_bytes"] > r["state_bytes"]
    assert r["memory_ratio"] == pytest.approx(r["steps_memory_bytes"] / r["memory_estimate_bytes"])
    assert r["final_loss"] > 0 and r["steps_timed"] == 4
    # the command restarts itself with glibc's heap on huge pages wherever the machine has them
    assert r["hugepages"] is (hugepage_env({}) is not None)


def test_bad_bench_flags_are_refused():
    res = run_cli("bench", "train-step", *TINY, "--steps", "0")
    assert res.returncode == 2 and "--steps" in res.stderr and res.stderr.count("\n") == 1
    res = run_cli("bench", "train-step", *TINY, "--top-k", "9")
    assert res.returncode == 2 and "model.top_k" in res.stderr
