"""`make demo`: Marin's hero and ladder as moelab counts them, then the ladder experiment.

The experiment (experiments/exp37_forecast_prior.py) goes through `moelab run`: its declaration
and prediction are journaled; four tiny rungs, two seeds each, train on the standard library (tokenizer, token
store, evals every 5%, checkpoints); the target's whole curve is forecast from them and the
forecast registered in the journal; the target trains, monitored against the forecast and the
rungs; its health summary and forecast error are judged; the site is written to runs/site.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from moelab import accounting
from moelab.cli.common import print_plan, print_summary
from moelab.config import load_config
from moelab.errors import UsageError
from moelab.presets import MARIN_LADDER
from moelab.runs import read_jsonl


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


ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "experiments" / "exp37_forecast_prior.py"
DEMO_LADDER = ROOT / "ladders" / "demo.yaml"


def print_forecast(health: dict) -> None:
    fc = health.get("forecast")
    if not fc:
        return
    print(
        f"\n  the registered forecast ({fc.get('law', 'per-fraction')}) against the target's held-out loss (dropless, {fc.get('metric', 'macro')}):"
    )
    print(f"  {'fraction':>8} {'step':>6} {'forecast':>9} {'band (90%)':>18} {'actual':>8} {'error':>7}")
    for p in fc["points"]:
        band = f"[{p['low']:.3f}, {p['high']:.3f}]"
        print(
            f"  {p['fraction']:>8.0%} {p['step']:>6} {p['predicted']:>9.4f} {band:>18} {p['actual']:>8.4f}"
            f" {p['error']:>+7.2%}"
        )
    print(
        f"  mean |error| {fc['mean_abs_error_pct']:.2f}%, largest {fc['max_abs_error_pct']:.2f}%; past 20% of the run:"
        f" mean {fc.get('mean_abs_error_past_20_pct', float('nan')):.2f}%, largest "
        f"{fc.get('max_abs_error_past_20_pct', float('nan')):.2f}%; final {fc['final_error_pct']:+.2f}%"
    )
    band = fc.get("final_band_pct")
    if band:
        print(f"  the final band: {band[0]:+.2f}% to {band[1]:+.2f}% of the forecast")
    print(f"  inside the band at {fc['inside_band']} of {len(fc['points'])} points")


def print_health(health: dict) -> None:
    print(f"\n  health of the target: {health['alerts']} ALERTs")
    for check, c in health["checks"].items():
        alert = f" (first ALERT at step {c['first_alert']})" if c["first_alert"] is not None else ""
        print(f"    {c['level']:<6} {check:<20} {c['evidence']}{alert}")


def run_demo(experiment: str | None = None, prefix: str = "runs/lab", site: str = "runs/site") -> int:
    """The accounting table, then an experiment through `moelab run` (by default the ladder:
    rungs, a registered forecast, a monitored target, its health and verdict), then the site."""
    import time

    from moelab.lab.commands import load_experiment
    from moelab.lab.executor import Runner
    from moelab.report.plots import forecast_figure
    from moelab.report.site import build_site

    t0 = time.time()
    if experiment is None and not (EXAMPLE.is_file() and DEMO_LADDER.is_file()):  # an install without the clone
        raise UsageError(
            f"moelab demo runs the repository's {EXAMPLE.relative_to(ROOT)} and {DEMO_LADDER.relative_to(ROOT)}, "
            "which this install does not hold: run it in a clone (make demo), or give --experiment FILE"
        )
    print_accounting()
    path = Path(experiment) if experiment else EXAMPLE
    exp = load_experiment(path)
    if experiment is None:
        from moelab.ladder.plan import load_ladder

        print(f"The ladder ({DEMO_LADDER.relative_to(ROOT)}):")
        print_plan(load_ladder(DEMO_LADDER))
        print()
    print(f"Running {path} ({exp.title}) with `moelab run`; finished steps under {prefix}/ are reused.")
    print(f"  hypothesis: {exp.hypothesis}\n  prediction: {exp.prediction.describe()}\n")
    runner = Runner(exp, prefix)
    result = runner.run()
    trained = [s for s in exp.all_steps() if (runner.out(s) / "summary.json").exists()]
    for step in trained:
        print(f"\n{step.name}:", end="")
        print_summary(json.loads((runner.out(step) / "summary.json").read_text()))
    if trained:
        last = [r for r in read_jsonl(runner.out(trained[-1]) / "metrics.jsonl") if r["kind"] == "train"][-1]
        print(f"\n  per-layer MoE metrics of {trained[-1].name} at its last step:")
        print_layer_table(last)
    registered = [e for e in runner.journal.read() if e["event"] == "forecast_registered"]
    if registered:
        r = registered[-1]
        print(
            f"\nforecast registered in the journal before the target trained: hash {r['hash']}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['time']))}"
        )
    for step in exp.all_steps():
        updates = read_jsonl(runner.out(step) / "forecast_updates.jsonl")
        if updates:
            u = updates[-1]
            print(
                f"\n{step.name}: the forecast refitted {len(updates)} times with the run's own evaluations (recorded "
                f"as updates; the registered forecast is what is judged); the last, at step {u['at_step']}: final "
                f"{u['final']['loss']:.4f} [{u['final']['low']:.4f}, {u['final']['high']:.4f}]"
            )
    for step in exp.all_steps():
        health = runner.out(step) / "health.json"
        if health.exists():
            h = json.loads(health.read_text())
            print_forecast(h)
            print_health(h)
    v = result["verdict"]
    if v:
        print(f"\nverdict: {result['headline']}: {v['why']} (predicted {v['predicted']:g})")
    else:
        print(f"\nno verdict: steps not finished: {result['steps']}")
    index = build_site(Path(prefix), Path(site))
    for step in exp.all_steps():
        fig = forecast_figure(runner.out(step))
        if fig is not None:
            fig.savefig(Path(site) / "forecast_vs_actual.svg", bbox_inches="tight")
            print(f"forecast plot: {(Path(site) / 'forecast_vs_actual.svg').resolve()}")
    print(f"\nsite: {index.resolve()}  (open it in a browser; it works offline)")
    print(f"demo finished in {time.time() - t0:.0f} s")
    return 0 if v else 1
