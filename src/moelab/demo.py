"""`make demo`: Marin's hero and ladder as moelab counts them, then the example experiment.

The experiment (experiments/exp4_tiny_stdlib.py) goes through `moelab run`: its declaration and
prediction are journaled, the tiny MoE trains on the standard library (tokenizer, token store,
evals every 5%, checkpoints), a checkpoint is evaluated, the verdict is recorded, and the site
is written to runs/site.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from moelab import accounting
from moelab.config import load_config
from moelab.presets import MARIN_LADDER
from moelab.train.record import read_jsonl


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


EXAMPLE = Path(__file__).resolve().parents[2] / "experiments" / "exp4_tiny_stdlib.py"


def run_demo(experiment: str | None = None, prefix: str = "runs/lab", site: str = "runs/site") -> int:
    """The accounting table, then the example experiment through `moelab run`, then its site."""
    from moelab.cli import print_summary
    from moelab.lab.commands import load_experiment
    from moelab.lab.executor import Runner
    from moelab.report.site import build_site

    print_accounting()
    path = Path(experiment) if experiment else EXAMPLE
    exp = load_experiment(path)
    print(f"Running {path} ({exp.title}) with `moelab run`; finished steps under {prefix}/ are reused.")
    print(f"  hypothesis: {exp.hypothesis}\n  prediction: {exp.prediction.describe()}\n")
    runner = Runner(exp, prefix)
    result = runner.run()
    for step in exp.all_steps():
        summary = runner.out(step) / "summary.json"
        if summary.exists():
            print_summary(json.loads(summary.read_text()))
            last = [r for r in read_jsonl(runner.out(step) / "metrics.jsonl") if r["kind"] == "train"][-1]
            print("\n  per-layer MoE metrics at the last step:")
            print_layer_table(last)
    v = result["verdict"]
    if v:
        print(f"\nverdict: {v['verdict']}: {v['why']} (predicted {v['predicted']:g})")
    else:
        print(f"\nno verdict: steps not finished: {result['steps']}")
    index = build_site(Path(prefix), Path(site))
    print(f"\nsite: {index.resolve()}  (open it in a browser; it works offline)")
    return 0 if v else 1
