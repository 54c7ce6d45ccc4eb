"""`make demo`: Marin's hero and ladder as moelab counts them, then the tiny MoE trained on stdlib.

The training part is a real run (tokenizer, token store, phased mixture, evals every 5%,
checkpoints) whose files stay in runs/ and whose summary is printed at the end.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from moelab import accounting
from moelab.config import load_config
from moelab.presets import MARIN_LADDER


def marin_reference() -> dict:
    return json.loads(resources.files("moelab").joinpath("reference/marin_hero.json").read_text())


def accounting_rows() -> list[dict]:
    """moelab's counts for the hero and each rung beside Marin's published figures."""
    ref = marin_reference()
    hero = ref["hero"]["expected"]
    published = {
        "marin-535b-a23b": (
            hero["total_params"],
            hero["active_params"],
            hero["train_flops_with_lm_head"],
            hero["train_flops_without_lm_head"],
        ),
    }
    for rung in ref["ladder"]:
        published[f"marin-ladder-{rung['name']}"] = (
            rung["expected_total"],
            rung["expected_active"],
            rung["expected_train_flops_with_lm_head"],
            rung["expected_train_flops_without_lm_head"],
        )
    rows = []
    for name in ("marin-535b-a23b",) + MARIN_LADDER:
        cfg = load_config(name)
        out = accounting.count(cfg).train(accounting.run_tokens(cfg))
        ours = (out["total_params"], out["active_params"], out["train_flops"], out["train_flops_without_lm_head"])
        rows.append({"name": name, "tokens": out["tokens"], "ours": ours, "marin": published[name]})
    return rows


def print_accounting() -> None:
    print("Marin's 535B-A23B and its ladder, counted by moelab (Marin's published figure in brackets)\n")
    head = f"{'config':<20} {'tokens':>9} {'total params':>20} {'active params':>20} {'train FLOPs':>22} {'w/o LM head':>22}"
    print(head)
    print("-" * len(head))
    h = accounting.human
    rows = accounting_rows()
    for r in rows:
        o, m = r["ours"], r["marin"]
        print(
            f"{r['name']:<20} {r['tokens']:>9.3g} {h(o[0]) + ' [' + h(m[0]) + ']':>20} {h(o[1]) + ' [' + h(m[1]) + ']':>20}"
            f" {f'{o[2]:.3g} [{m[2]:.3g}]':>22} {f'{o[3]:.3g} [{m[3]:.3g}]':>22}"
        )
    worst = max(abs(o / m - 1) for r in rows for o, m in zip(r["ours"], r["marin"], strict=True))
    print(f"\nlargest relative difference from Marin's figures: {worst:.3%}\n")


def print_layer_table(rec: dict) -> None:
    cols = ("dropped_frac", "spilled_frac", "max_mean_load", "router_entropy", "router_z", "bias_std")
    print(f"  {'layer':<6}" + "".join(f"{c:>15}" for c in cols))
    for i in range(len(rec["dropped_frac_per_layer"])):
        print(f"  {i:<6}" + "".join(f"{float(rec[c + '_per_layer'][i]):>15.4f}" for c in cols))


def run_demo(steps: int | None = None, out: str | None = None, overrides: list[str] | None = None) -> int:
    """The accounting table, then the tiny preset trained on the standard library with evals."""
    from datetime import datetime

    from moelab.cli import print_summary
    from moelab.train.loop import train
    from moelab.train.record import read_jsonl

    print_accounting()
    cfg = load_config("tiny", list(overrides or []) + ([f"train.steps={steps}"] if steps else []))
    m = cfg.model
    a = accounting.count(cfg)
    out = out or f"runs/demo-{datetime.now():%Y%m%d-%H%M%S}"
    print(
        f"Training the tiny preset on the standard library's source into {out}:\n"
        f"  {a.total_params:,} parameters ({a.active_params:,} active), {m.n_routed} routed experts top-{m.top_k}, "
        f"{m.n_shared} shared, latent {m.latent_dim}, window {m.sliding_window} with every {m.global_every}nd layer "
        f"global, {m.router} router with {m.bias_update} bias, dispatch {m.dispatch} (CF {m.capacity_factor});\n"
        f"  {cfg.train.steps} steps of {cfg.train.batch_size} x {m.seq_len} tokens, held-out evals every 5%.\n"
        "  The first run also trains the tokenizer and builds the token store (cached in .moelab_cache/)."
    )
    summary = train(cfg, out)
    print_summary(summary)
    last = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if r["kind"] == "train"][-1]
    print("\nper-layer MoE metrics at the last step:")
    print_layer_table(last)
    print(
        f"\nits files: {out}/ (config.json, metrics.jsonl, events.jsonl, summary.json, ckpt/); "
        f"evaluate a checkpoint again: moelab eval {out}"
    )
    return 0
