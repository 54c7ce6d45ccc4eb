"""The site's figures, drawn by matplotlib and inlined as SVG: a run's curves (loss, learning rate,
gradient norms, drops, expert load, router entropy, throughput), its tasks, and a forecast against
the run it forecast."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from moelab.runs import read_jsonl


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _fig(title: str, xlabel: str = "step", ylabel: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _per_layer(steps: np.ndarray, tr: list[dict], key: str, title: str) -> str:
    fig, ax = _fig(title)
    per = np.array([r[key] for r in tr])
    for i in range(per.shape[1]):
        ax.plot(steps, per[:, i], label=f"layer {i}")
    ax.legend(fontsize=7)
    return _svg(fig)


def forecast_figure(run_dir: Path):
    """The forecast (line and band) against the run's held-out curve and the rungs' curves, over
    the fraction of each run; None when the run has no forecast.json or no evaluations."""
    path = run_dir / "forecast.json"
    if not path.exists():
        return None
    fc = json.loads(path.read_text())
    ev = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "eval" and r["step"] > 0]
    if not ev:
        return None
    steps = fc["steps"][-1] / fc["fractions"][-1]
    law = fc.get("law", "per-fraction")
    agg = fc.get("metric", "macro")  # what the forecast is of (older forecasts: the macro loss)
    fig, ax = _fig(
        f"Forecast of {fc.get('target', run_dir.name)} ({law}) against its held-out loss",
        xlabel="fraction of the run",
        ylabel=f"held-out loss, dropless, {agg} (nats / token)",
    )
    seen = [r["loss_dropless"][agg] for r in ev]
    for rung in fc.get("rungs", []):
        recs = [r for r in read_jsonl(Path(rung) / "metrics.jsonl") if r.get("kind") == "eval" and r["step"] > 0]
        cfg = Path(rung) / "config.json"
        if recs and cfg.exists():
            n = json.loads(cfg.read_text())["config"]["train"]["steps"]
            ax.plot([r["step"] / n for r in recs], [r["loss_dropless"].get(agg) for r in recs], color="0.75", lw=1)
            seen += [r["loss_dropless"][agg] for r in recs if agg in r["loss_dropless"]]
    ax.plot([], [], color="0.75", lw=1, label="ladder rungs")
    curve = fc.get("curve") or {"steps": fc["steps"], "loss": fc["loss"], "low": fc["low"], "high": fc["high"]}
    x = [s / steps for s in curve["steps"]]
    level = fc.get("band", {}).get("level", 0.9)
    ax.fill_between(x, curve["low"], curve["high"], alpha=0.25, color="C0", label=f"registered band ({level:.0%})")
    ax.plot(x, curve["loss"], color="C0", ls="--", label="registered forecast")
    for e in [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "forecast"][:-1]:
        older = run_dir / e["path"]  # a version before the newest (a re-plan replaced it): drawn faint
        if older.is_file():
            o = json.loads(older.read_text())
            ax.plot(
                [s / steps for s in o["steps"]],
                o["loss"],
                color="0.5",
                ls="--",
                lw=0.8,
                label=f"forecast version {e['version']} ({e['source']})",
            )
    updates = read_jsonl(run_dir / "forecast_updates.jsonl")
    if updates:  # the newest refit with the run's own evaluations: an update, drawn apart
        u = updates[-1]
        ax.plot([s / steps for s in u["steps"]], u["loss"], color="C2", ls=":", label=f"updated at step {u['at_step']}")
    ax.plot(
        [r["step"] / steps for r in ev],
        [r["loss_dropless"][agg] for r in ev],
        color="C3",
        marker=".",
        label="actual",
    )
    lows = [x for x in (*fc["low"], *seen) if x == x]
    ax.set_ylim(0.95 * min(lows), 1.05 * max(seen))  # the measured curves, not the law before its first point
    ax.legend(fontsize=7)
    return fig


def task_plots(ev: list[dict]) -> list[tuple[str, str]]:
    """One plot per task of train.task_evals against tokens: accuracy and length-normalised accuracy
    with the chance level (multiple choice), the target's bits per byte, or a generation task's pass@k
    with the held-out loss beside it."""
    scored = [r for r in ev if r.get("tasks")]
    out = []
    for name in scored[0]["tasks"] if scored else []:
        rows = [r for r in scored if name in r["tasks"]]
        tokens = [r["tokens"] for r in rows]
        got = [r["tasks"][name] for r in rows]
        if "acc" in got[0]:
            fig, ax = _fig(f"Task {name}: accuracy by log-likelihood", xlabel="tokens", ylabel="accuracy")
            ax.plot(tokens, [g["acc"] for g in got], marker=".", label="acc")
            ax.plot(tokens, [g["acc_norm"] for g in got], marker=".", ls="--", label="acc_norm (per character)")
            ax.axhline(got[0]["chance"], color="0.4", ls=":", label=f"chance {got[0]['chance']:.3g}")
            ax.set_ylim(0, 1)
        elif "pass@1" in got[0]:  # a generation task: pass@k, beside the held-out loss at the same evaluations
            fig, ax = _fig(f"Task {name}: pass@k of the completions it writes", xlabel="tokens", ylabel="pass@k")
            for key in sorted((k for k in got[0] if k.startswith("pass@")), key=lambda k: int(k[5:])):
                ax.plot(tokens, [g.get(key, float("nan")) for g in got], marker=".", label=key)
            ax.set_ylim(-0.02, 1.02)
            if all("macro" in (r.get("loss") or {}) for r in rows):
                twin = ax.twinx()
                twin.plot(
                    tokens, [r["loss"]["macro"] for r in rows], color="0.5", ls=":", label="held-out loss (macro)"
                )
                twin.set_ylabel("nats / token")
                twin.legend(fontsize=7, loc="upper center")
        else:
            fig, ax = _fig(f"Task {name}: the target's bits per byte", xlabel="tokens", ylabel="bits / byte")
            ax.plot(tokens, [g["bpb"] for g in got], marker=".", label="bits per byte")
        ax.legend(fontsize=7)
        out.append((f"task-{name}", _svg(fig)))
    return out


def run_plots(run_dir: Path) -> list[tuple[str, str]]:
    """(title, inline svg) for one training run's metrics.jsonl."""
    recs = read_jsonl(run_dir / "metrics.jsonl")
    tr = [r for r in recs if r.get("kind") == "train"]
    ev = [r for r in recs if r.get("kind") == "eval"]
    plots = []
    if not tr and not ev:
        return plots
    steps = np.array([r["step"] for r in tr])
    plots.append(("loss", _loss_plot(run_dir, steps, tr, ev)))
    plots.extend(task_plots(ev))
    fig = forecast_figure(run_dir)
    if fig is not None:
        plots.append(("forecast", _svg(fig)))
    if tr:
        plots.extend(_training_plots(steps, tr))
    return plots


def _loss_plot(run_dir: Path, steps: np.ndarray, tr: list[dict], ev: list[dict]) -> str:
    """The training loss and the held-out loss per domain, where each context length starts, and the
    forecast's band."""
    fig, ax = _fig("Loss: training, and held-out per domain", ylabel="nats / token")
    if tr:
        ax.plot(steps, [r["loss"] for r in tr], color="0.6", lw=1, label="train (batch)", gid="train-loss")
    if ev:
        for d in ev[0]["loss"]:
            ax.plot(
                [r["step"] for r in ev],
                [r["loss"][d] for r in ev],
                marker=".",
                lw=1.5 if d == "macro" else 1,
                label=f"held-out {d}",
            )
        # a long-context phase: where each length starts (a resume repeats its length's event: not a change)
        seen = sorted(
            {(e["step"], e["seq_len"]) for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "context"}
        )
        for (_, before), (step, length) in zip(seen, seen[1:], strict=False):
            if length != before:
                ax.axvline(step, color="0.5", ls=":", lw=1)
                ax.annotate(f"{length} tokens from here", (step, 0.98), xycoords=("data", "axes fraction"),
                            fontsize=7, ha="right", va="top", rotation=90)  # fmt: skip
        forecast = run_dir / "forecast.json"
        if forecast.exists():
            f = json.loads(forecast.read_text())
            ax.fill_between(f["steps"], f["low"], f["high"], alpha=0.2, label="forecast band")
    ax.legend(fontsize=7)
    return _svg(fig)


def _training_plots(steps: np.ndarray, tr: list[dict]) -> list[tuple[str, str]]:
    """The curves of the training records: learning rate, gradient norms, drops, expert load, router
    entropy, throughput."""
    plots = []
    fig, ax = _fig("Learning rate")
    ax.plot(steps, [r["lr"] for r in tr])
    plots.append(("lr", _svg(fig)))

    fig, ax = _fig("Gradient norm per parameter group")
    for g in tr[0]["grad_norm_groups"]:
        ax.plot(steps, [r["grad_norm_groups"][g] for r in tr], label=g)
    ax.plot(steps, [r["grad_norm"] for r in tr], color="k", lw=1.5, label="global")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    plots.append(("grad_norm", _svg(fig)))

    plots.append(
        ("dropped", _per_layer(steps, tr, "dropped_frac_per_layer", "Dropped fraction of assignments per layer"))
    )

    plots.append(("expert_load", _expert_load(steps, tr)))

    plots.append(
        (
            "router_entropy",
            _per_layer(steps, tr, "router_entropy_per_layer", "Router entropy (1 = uniform over experts)"),
        )
    )

    fig, ax = _fig("Throughput", ylabel="tokens / s")
    ax.plot(steps, [r["tokens_per_s"] for r in tr], label="tokens/s")
    ax2 = ax.twinx()
    ax2.plot(steps, [100 * r["mfu"] for r in tr], color="tab:red", label="MFU %")
    ax2.set_ylabel("MFU (%)")
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    plots.append(("throughput", _svg(fig)))
    return plots


def _expert_load(steps: np.ndarray, tr: list[dict]) -> str:
    """Each expert's load over the steps (load / the layer's mean), at up to four layers."""
    load = np.array([r["expert_load"] for r in tr], dtype=float)  # [steps, layers, experts]
    layers = sorted(set(np.linspace(0, load.shape[1] - 1, min(load.shape[1], 4)).round().astype(int)))
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(layers), 1, figsize=(6.4, 1.6 * len(layers) + 0.8), squeeze=False)
    for ax, layer in zip(axes[:, 0], layers, strict=True):
        rel = load[:, layer, :] / load[:, layer, :].mean(axis=1, keepdims=True)
        im = ax.imshow(
            rel.T,
            aspect="auto",
            cmap="viridis",
            origin="lower",
            extent=(steps[0], steps[-1], -0.5, rel.shape[1] - 0.5),
            vmin=0,
        )
        ax.set_ylabel(f"layer {layer}\nexpert", fontsize=8)
    axes[0, 0].set_title("Expert load over steps (load / mean load)", fontsize=11)
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(im, ax=axes[:, 0].tolist(), shrink=0.8)
    return _svg(fig)
