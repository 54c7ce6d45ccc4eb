"""The speed page of the manual's results (docs/results/speed.md): issue 42's three figures in one
place, each with its target and the prediction registered before it ran: the train step against
transformers' Qwen2-MoE at every shape measured (with the profile by op where one was taken), the
step with a checkpoint save in flight, and the cold start. Written from benchmarks/results/ by
results_pages.py; no figure is typed here."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _predictions(prefix: str) -> str:
    found = sorted(p.name for p in RESULTS.glob(f"{prefix}*prediction*.md"))
    return ", ".join(f"`{n}`" for n in found) if found else "none registered"


def _step_rows(name: str, d: dict, shapes: dict, setting: str, shape_of: dict) -> list[str]:
    rows = []
    for shape, r in shapes.items():
        s = r.get("shape") or shape_of[shape]
        ok = "met" if r["ratio"] >= 1.0 else "missed"
        rows.append(
            f"| {shape} | {s['d_model']} | {s['layers']} | {s['experts']} ({s['top_k']}) | {s['seq']} x {s['batch']} "
            f"| {setting} | {r['moelab_tokens_per_s']:,.0f} | {r['transformers_tokens_per_s']:,.0f} "
            f"| **{r['ratio']:.2f}x** ({ok}) | {d.get('date', '')} | [{name}]({name}.md) |"
        )
    return rows


def step_section() -> list[str]:
    out = ["## The train step against transformers' Qwen2-MoE\n",
           "Tokens per second, same shapes and threads, the two frameworks alternating in one run; the ratio is "
           "moelab's over PyTorch's. Target: at least 1.0x at every shape.\n",
           "| shape | d_model | layers | experts (top-k) | seq x batch | allocator | moelab tok/s | transformers tok/s "
           "| ratio | measured | page |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in ("vs_transformers", "vs_transformers_cd"):
        d = _load(name)
        if d is None:
            continue
        shape_of = {k: r["shape"] for k, r in d["shapes"].items()}
        out += _step_rows(name, d, d["shapes"], "default (huge pages)", shape_of)
        keep = d.get("with_malloc_keep")
        if isinstance(keep, dict) and keep.get("shapes"):  # the same shapes, so their sizes are the run's
            out += _step_rows(name, {"date": keep.get("date", d.get("date", ""))}, keep["shapes"],
                              "`MOELAB_MALLOC=keep`", shape_of)  # fmt: skip
    out.append(f"\nPredictions: {_predictions('vs_transformers')}, each on its result's page.\n")
    for path in sorted(RESULTS.glob("vs_transformers_parts*.json")):
        p = json.loads(path.read_text())
        shape = p.get("shape", {})
        out.append(f"### Where the time goes, shape {shape.get('name', '?')} ([{path.stem}]({path.stem}.md))\n")
        out += ["| part (one layer, forward and backward) | moelab ms | transformers ms | ratio |", "|---|---|---|---|"]
        for part, r in p.get("parts", {}).items():
            j, t = r.get("moelab_fwd+bwd_ms"), r.get("transformers_fwd+bwd_ms")
            if j and t:
                out.append(f"| {part} | {j:.1f} | {t:.1f} | {t / j:.2f}x |")
        ops = p.get("moelab_profile", {}).get("top_ops", [])[:8]
        if ops:
            out += ["", "moelab's whole step, costliest ops:", "", "| op | ms | shape | from |", "|---|---|---|---|"]
            out += [f"| `{o.get('op', '?')}` | {o.get('ms', 0):.1f} | `{o.get('shape', '')}` | `{o.get('from', '')}` |"
                    for o in ops]  # fmt: skip
        out.append("")
    return out


def save_section() -> list[str]:
    d = _load("checkpoint_async")
    out = ["## A step with a checkpoint save in flight\n"]
    if d is None:
        return out + ["Not measured yet (`benchmarks/checkpoint_async.py`).\n"]
    out += [f"State of {d['state_bytes'] / 1e9:.2f} GB; the step's time with a background save in flight over its time "
            f"without one. Target: at most {d.get('target_ratio', 1.15)}x. A synchronous save of the same state: "
            f"{d['sync_save_s']:.2f} s. Measured {d.get('date', '')} ([checkpoint_async](checkpoint_async.md)).\n",
            "| train.checkpoint_writer | ratio | the loop blocked per save | complete after | predicted |",
            "|---|---|---|---|---|"]  # fmt: skip
    writers = d.get("writers") or {"thread": d}
    for w, f in writers.items():
        rounds = f.get("rounds", [])
        blocked = sum(r["save_blocked_s"] for r in rounds) / max(len(rounds), 1)
        done = sum(r["save_complete_s"] for r in rounds) / max(len(rounds), 1)
        pred = d.get("predicted_ratio")
        pred = pred.get(w) if isinstance(pred, dict) else pred
        ok = "met" if f["ratio"] <= d.get("target_ratio", 1.15) else "missed"
        out.append(f"| {w} | **{f['ratio']:.2f}x** ({ok}) | {blocked:.2f} s | {done:.2f} s | {pred} |")
    out.append(f"\nPredictions: {_predictions('checkpoint_async')}.\n")
    return out


def cold_section() -> list[str]:
    d = _load("cold_start")
    out = ["## The cold start\n"]
    if d is None:
        return out + ["Not measured yet (`benchmarks/cold_start.py`).\n"]
    out += [f"`{d['command']}`: seconds to the first step, median of {d['rounds']}, against {d['baseline']} in the "
            f"same run. Target: {d['target_first_step_s']} s. Measured {d.get('date', '')} "
            "([cold_start](cold_start.md)).\n",
            "| cold process | now | before | phases now (wall s) |", "|---|---|---|---|"]  # fmt: skip
    for kind, by in d["results"].items():
        now, before = by["now"], by["baseline"]
        ok = "met" if now["first_step_s"] <= d["target_first_step_s"] else "missed"
        phases = ", ".join(f"{k} {v:.1f}" for k, v in now["phases_wall"].items() if v >= 0.5)
        out.append(f"| {kind} | **{now['first_step_s']:.1f} s** ({ok}) | {before['first_step_s']:.1f} s | {phases} |")
    out.append(f"\nPredictions: {_predictions('cold_start')}.\n")
    return out


def speed_page() -> str:
    head = ["# Speed: parity, saves, the cold start\n",
            "Issue 42's figures, measured alone on the 2-core CPU machine, each beside its target and the "
            "prediction committed before it ran (outcome and misses on each result's own page).\n"]  # fmt: skip
    return "\n".join(head + step_section() + save_section() + cold_section()).rstrip() + "\n"
