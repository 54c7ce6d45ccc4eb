"""`moelab report`: a static site of every experiment and every plain run under a prefix, readable offline.

An experiment is found by its journal (``experiments/NAME/journal.jsonl`` under the prefix or a
folder below it); a plain run (`moelab train --out DIR`) by its ``config.json`` in a folder that is
no lab step's output. The index lists both; each gets a page.

Plain HTML and CSS with the plots inlined as SVG by matplotlib (``moelab.report.plots``): no
JavaScript, no CDN, no server, so the pages open from a folder, an archive or a mail attachment
exactly as written. Every piece of user text goes through ``html.escape``.
"""

from __future__ import annotations

import difflib
import html
import json
import time
from pathlib import Path

from moelab import accounting
from moelab.config import config_from_dict
from moelab.lab.journal import Journal, attempt_rows, headline, record, verdict_text
from moelab.report.plots import run_plots
from moelab.runs import read_jsonl

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;
vertical-align:top;font-size:.92em}th{background:#f4f4f4}pre{background:#f7f7f7;padding:.6em;overflow-x:auto;
font-size:.85em;white-space:pre-wrap}.CONFIRMED{color:#0a7a28;font-weight:bold}.FALSIFIED{color:#b00020;
font-weight:bold}.INCONCLUSIVE{color:#a66b00;font-weight:bold}.fail td{background:#fde8e8}
.change td{background:#fff6d6}.plots{display:flex;flex-wrap:wrap;gap:1em}.plot{flex:1 1 480px}
.plot svg{width:100%;height:auto}.muted{color:#777}.ALERT{color:#b00020;font-weight:bold}.WATCH{color:#a66b00}
.posthoc{color:#6b4c9a;font-style:italic}
"""

E = html.escape


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{E(title)}</title>"
        f"<meta name=viewport content='width=device-width'><style>{CSS}</style></head><body>{body}"
        f"<p class=muted>Written by moelab report on {time.strftime('%Y-%m-%d %H:%M')}.</p></body></html>"
    )


def _timeline(events: list[dict]) -> str:
    rows = []
    for e in sorted(events, key=lambda e: e.get("time", 0)):
        kind = e.get("event", "")
        cls = (
            "fail"
            if kind in ("step_failed", "failure", "nan_skip", "nan_restore", "restart", "gave_up")
            else ("change" if kind in ("change", "declared", "prediction_registered", "replan") else "")
        )
        detail = {k: v for k, v in e.items() if k not in ("time", "event", "traceback", "source")}
        tb = e.get("traceback")
        text = E(json.dumps(detail, default=str)[:600])
        if tb:
            text += f"<details><summary>traceback</summary><pre>{E(tb)}</pre></details>"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("time", 0)))
        rows.append(
            f"<tr class='{cls}'><td>{when}</td><td>{E(e.get('source', ''))}</td><td>{E(kind)}</td><td>{text}</td></tr>"
        )
    return "<table><tr><th>time</th><th>where</th><th>event</th><th>detail</th></tr>" + "".join(rows) + "</table>"


def _config_of(prefix: Path, dirname: str) -> str | None:
    prov = prefix / dirname / "provenance.json"
    cfg = prefix / dirname / "config.json"
    parts = {}
    if prov.exists():
        parts["step"] = json.loads(prov.read_text())["config"]
    if cfg.exists():
        parts["run"] = json.loads(cfg.read_text())["config"]
    return json.dumps(parts, indent=1, sort_keys=True) if parts else None


def _health_section(name: str, health: dict, journal: list[dict]) -> str:
    """The health checks' levels and the forecast's error at every 5%, from a health step."""
    out = [f"<h2>Health: {E(name)}</h2><p>{health['alerts']} ALERTs.</p>"]
    out.append("<table><tr><th>check</th><th>level</th><th>first ALERT</th><th>evidence</th></tr>")
    for check, c in health["checks"].items():
        alert = "" if c["first_alert"] is None else str(c["first_alert"])
        out.append(
            f"<tr><td>{E(check)}</td><td class='{E(c['level'])}'>{E(c['level'])}</td><td>{alert}</td>"
            f"<td>{E(c['evidence'])}</td></tr>"
        )
    out.append("</table>")
    versions = health.get("forecast_versions") or []
    if len(versions) > 1:
        out.append(
            "<p>The run's forecast has " + str(len(versions)) + " versions; the newest is the one judged:</p><ul>"
        )
        for v in versions:
            why = f": {E(v['reason'])}" if v.get("reason") else ""
            out.append(f"<li>version {v['version']}, hash <code>{E(v['hash'])}</code>, {E(v['source'])}{why}</li>")
        out.append("</ul>")
    fc = health.get("forecast")
    if fc:
        reg = [e for e in journal if e["event"] == "forecast_registered"]
        when = (
            f" Registered in the journal (hash <code>{E(reg[-1]['hash'])}</code>) at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(reg[-1]['time']))}, before the target's first step."
            if reg
            else ""
        )
        out.append(
            f"<h3>Forecast against outcome</h3><p>Mean absolute error {fc['mean_abs_error_pct']:.2f}%, largest "
            f"{fc['max_abs_error_pct']:.2f}%, at the end {fc['final_error_pct']:+.2f}%; the actual loss is inside "
            f"the band at {fc['inside_band']} of {len(fc['points'])} points.{when}</p>"
        )
        out.append(
            "<table><tr><th>fraction</th><th>step</th><th>forecast</th><th>band</th><th>actual</th><th>error</th></tr>"
        )
        for p in fc["points"]:
            out.append(
                f"<tr><td>{p['fraction']:.0%}</td><td>{p['step']}</td><td>{p['predicted']:.4f}</td>"
                f"<td>[{p['low']:.4f}, {p['high']:.4f}]</td><td>{p['actual']:.4f}</td><td>{p['error']:+.2%}</td></tr>"
            )
        out.append("</table>")
    return "".join(out)


def experiment_page(prefix: Path, journal_path: Path) -> tuple[str, dict]:
    """An experiment's page (its declaration, prediction against outcome, steps, health, configuration,
    plots and timeline) and its index row."""
    events = Journal(journal_path).read()
    declared = [e for e in events if e["event"] == "declared"]
    rec = record(events)
    decl = declared[-1] if declared else {"title": journal_path.parent.name, "steps": []}
    counted = rec["declaration"] or decl  # the goal and hypothesis on record before the first step
    name = journal_path.parent.name
    body = [
        f"<p><a href='index.html'>all experiments</a></p><h1>{E(decl.get('title', name))}</h1>",
        f"<p class=muted>{E(name)}, issue #{E(str(decl.get('issue', '')))}, declaration version {len(declared)}</p>",
    ]
    for key in ("goal", "hypothesis", "description"):
        if counted.get(key):
            body.append(f"<h2>{key.capitalize()}</h2><p>{E(counted[key])}</p>")
    for d in rec["post_hoc_declarations"]:
        body.append(
            f"<p class=posthoc>POST HOC: declaration version {d['version']}, recorded {_when(d['time'])}, after the "
            f"first step started: hypothesis <q>{E(d.get('hypothesis', ''))}</q></p>"
        )
    body += _prediction_section(rec, events, declared)
    steps, step_events, compute, statuses = _steps_section(prefix, decl)
    body.append(steps)
    for s in decl.get("steps", []):
        health = prefix / s["dir"] / "health.json"
        if health.exists():
            body.append(_health_section(s["name"], json.loads(health.read_text()), events))
    body += _config_section(prefix, decl, declared)

    for s in decl.get("steps", []):
        plots = run_plots(prefix / s["dir"])
        if plots:
            body.append(f"<h2>Plots: {E(s['name'])}</h2><div class=plots>")
            body.extend(f"<div class='plot' id='{E(s['name'])}-{k}'>{svg}</div>" for k, svg in plots)
            body.append("</div>")

    body.append("<h2>Timeline</h2>")
    shown = [{**e, "verdict": verdict_text(e, rec["verdict"])} if e["event"] == "verdict" else e for e in events]
    body.append(_timeline([{**e, "source": "journal"} for e in shown] + step_events))
    overall = (
        "FAILED"
        if "FAILED" in statuses.values()
        else (
            "DONE"
            if statuses and all(v == "SUCCESS" for v in statuses.values())
            else "RUNNING"
            if "RUNNING" in statuses.values()
            else "PENDING"
        )
    )
    info = {
        "name": name,
        "title": decl.get("title", name),
        "status": overall,
        "verdict": headline(rec),
        "verdict_class": rec["verdict"]["verdict"] if rec["verdict"] else "-",
        "post_hoc": [x["verdict"] for x in rec["post_hoc_verdicts"]],
        "compute": compute,
    }
    return _page(decl.get("title", name), "".join(body)), info


def _prediction_section(rec: dict, events: list[dict], declared: list[dict]) -> list[str]:
    """The prediction on record against the outcome: the verdict, every attempt, the post hoc ones."""
    preds = [e for e in events if e["event"] == "prediction_registered"]
    body = ["<h2>Prediction against outcome</h2>"]
    first = f"the first step started {_when(rec['first_step'])}" if rec["first_step"] else "no step has started yet"
    pre = rec["prediction"]
    if pre is not None:
        body.append(
            f"<p>Registered before the run (version {pre['version']}, hash <code>{E(pre['hash'])}</code>, "
            f"{_when(pre['time'])}; {first}): {E(pre['text'])}</p>"
        )
    else:
        body.append(f"<p class=posthoc>No prediction was on record before the first step ({first}).</p>")
    v = rec["verdict"]
    if v:  # the first attempt's verdict; a later attempt's that differs is written beside it, never instead
        body.append(
            f"<p class='{E(v['verdict'])}'>{E(headline(rec))}</p><p>{E(v['metric'])}: outcome "
            f"{E(str(v['outcome']))}, predicted {E(str(v['predicted']))}; {E(v['why'])}</p>"
        )
    else:
        body.append("<p>No verdict yet.</p>")
    attempts = attempt_rows(rec)
    if len(attempts) > 1:
        body.append("<h3>Attempts at the registered prediction</h3><p>The first attempt's verdict is the one that "
                    "counts; every later one is listed with what changed.</p><table><tr><th>attempt</th><th>when</th>"
                    "<th>why</th><th>verdict</th><th>steps (identity)</th></tr>")  # fmt: skip
        for a in attempts:
            graph = ", ".join(f"{k} <code>{E(x)}</code>" for k, x in a["graph"].items())
            body.append(f"<tr><td>{a['number']}</td><td>{E(a['when'])}</td><td>{E(a['why'])}</td>"
                        f"<td>{E(a['verdict'] or 'no verdict')}</td><td>{graph}</td></tr>")  # fmt: skip
        body.append("</table>")
    for p in rec["post_hoc_predictions"]:
        late = next((x for x in rec["post_hoc_verdicts"] if x["prediction_hash"] == p["hash"]), None)
        body.append(
            f"<p class=posthoc>POST HOC: prediction version {p['version']} (hash <code>{E(p['hash'])}</code>), "
            f"registered {_when(p['time'])}, after the first step started: {E(p['text'])}"
            + (f". Against it: {E(late['verdict'])} ({E(late['why'])})" if late else "")
            + "</p>"
        )
    if len(declared) > 1 or len(preds) > 1:
        body.append(
            f"<p>{len(declared)} declaration and {len(preds)} prediction versions are on record; "
            "every one is in the timeline below.</p>"
        )
    return body


def _steps_section(prefix: Path, decl: dict) -> tuple[str, list[dict], float, dict[str, str]]:
    """(the steps' table, their runs' events, the training FLOPs of the finished runs, each step's status)."""
    step_events, compute, statuses = [], 0.0, {}
    body = ["<h2>Steps</h2><table><tr><th>step</th><th>status</th><th>output</th></tr>"]
    for s in decl.get("steps", []):
        status_path = prefix / f"{s['dir']}.status"
        status = json.loads(status_path.read_text())["status"] if status_path.exists() else "PENDING"
        statuses[s["name"]] = status
        body.append(f"<tr><td>{E(s['name'])}</td><td>{E(status)}</td><td><code>{E(s['dir'])}</code></td></tr>")
        for e in read_jsonl(prefix / s["dir"] / "events.jsonl"):
            step_events.append({**e, "source": s["name"]})
        summary = prefix / s["dir"] / "summary.json"
        cfg_path = prefix / s["dir"] / "config.json"
        if summary.exists() and cfg_path.exists():
            cfg = config_from_dict(json.loads(cfg_path.read_text())["config"])
            compute += accounting.run_train(cfg)["train_flops"]
    body.append("</table>")
    return "".join(body), step_events, compute, statuses


def _config_section(prefix: Path, decl: dict, declared: list[dict]) -> list[str]:
    """Each step's configuration, and its diff against the previous declaration's where it changed."""
    body = ["<h2>Configuration</h2>"]
    previous = {p["name"]: p["dir"] for p in declared[-2]["steps"]} if len(declared) > 1 else {}
    for s in decl.get("steps", []):
        text = _config_of(prefix, s["dir"])
        if text is None:
            continue
        body.append(f"<details><summary>{E(s['name'])}</summary><pre>{E(text)}</pre></details>")
        old_dir = previous.get(s["name"])
        if old_dir and old_dir != s["dir"]:
            old = _config_of(prefix, old_dir)
            if old:
                diff = "\n".join(
                    difflib.unified_diff(
                        old.splitlines(), text.splitlines(), "previous version", "this version", lineterm=""
                    )
                )
                body.append(f"<p>Diff against the previous version:</p><pre>{E(diff)}</pre>")
    return body


SKIP_DIRS = ("ckpt", "evals", "experiments", "tensorboard", "wandb")  # a run's or a lab's own folders


def find_records(prefix: Path) -> tuple[list[Path], list[Path]]:
    """(journals of experiments, plain run folders) under ``prefix``, sorted. A lab prefix below it
    counts (``--prefix runs`` finds runs/lab's experiments); a lab step's output (it has its
    provenance.json or its .status beside it), an attempt and a set-aside output are the lab's, not runs."""
    journals, runs = [], []
    stack = [prefix]
    while stack:
        folder = stack.pop()
        if (folder / "config.json").is_file():  # a run (the prefix may be one), or a lab step's output
            if _is_run(folder):
                runs.append(folder)
            continue  # a run's own folders hold no other run
        journals.extend(folder.glob("experiments/*/journal.jsonl"))
        try:
            below = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            continue
        stack.extend(p for p in below if not p.name.startswith(".") and p.name not in SKIP_DIRS
                     and not p.name.endswith(".attempts") and ".replaced-" not in p.name)  # fmt: skip
    return sorted(journals), sorted(runs)


def _is_run(folder: Path) -> bool:
    """A plain run's folder: its config.json as a run writes it, and no lab step's marks."""
    cfg = folder / "config.json"
    if not cfg.is_file() or (folder / "provenance.json").exists():
        return False
    if folder.with_name(folder.name + ".status").exists():  # a lab step's output before its provenance
        return False
    try:
        rec = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(rec, dict) and isinstance(rec.get("config"), dict) and "hash" in rec


def _rel(prefix: Path, run_dir: Path) -> str:
    """The run's path under the prefix (its own name when the prefix is the run)."""
    return run_dir.name if run_dir == prefix else run_dir.relative_to(prefix).as_posix()


def run_page_name(prefix: Path, run_dir: Path) -> str:
    """run-<the run's path under the prefix>.html, slashes as '__' (an experiment's page is its name)."""
    rel = _rel(prefix, run_dir).replace("/", "__")
    return "run-" + "".join(c if c.isalnum() or c in "._-" else "-" for c in rel) + ".html"


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, float) else E(str(x))


def _after_training(run_dir: Path) -> str:
    """`moelab eval`'s results kept in the run's evals/: held-out loss, tasks, retrieval, the harness."""
    out = []
    for path in sorted((run_dir / "evals").glob("*.json")):
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError):
            out.append(f"<p class=muted>{E(path.name)}: not readable as JSON</p>")
            continue
        rows = []
        for key in ("loss", "bpb", "loss_dropless", "bpb_dropless", "acc"):
            if isinstance(res.get(key), dict):
                rows += [(f"{key} {k}", v) for k, v in res[key].items() if isinstance(v, (int, float))]
        for task, got in (res.get("tasks") or {}).items():
            if isinstance(got, dict):
                rows += [(f"{task} {k}", v) for k, v in got.items() if isinstance(v, (int, float))]
        table = "".join(f"<tr><td>{E(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in rows)
        out.append(
            f"<h3>{E(path.name)}</h3>"
            + (f"<table><tr><th>metric</th><th>value</th></tr>{table}</table>" if rows else "")
            + f"<details><summary>the whole result</summary><pre>{E(json.dumps(res, indent=1)[:20000])}</pre></details>"
        )
    return "<h2>Evaluations after training</h2>" + "".join(out) if out else ""


def run_info(prefix: Path, run_dir: Path) -> dict:
    """A plain run's row: status (finished, failed, unfinished), steps done and planned, tokens, the last
    train and held-out losses, training FLOPs (`moelab status` prints it; the index shows it)."""
    return _run_records(prefix, run_dir)[0]


def _run_records(prefix: Path, run_dir: Path) -> tuple[dict, dict, list]:
    """(its index row, its saved config.json, its events)."""
    rel = _rel(prefix, run_dir)
    saved = json.loads((run_dir / "config.json").read_text())
    recs = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    tr = [r for r in recs if r.get("kind") == "train"]
    ev = [r for r in recs if r.get("kind") == "eval"]
    planned = saved["config"].get("train", {}).get("steps")
    last_event = next((e["event"] for e in reversed(events) if e.get("event") not in ("checkpoint",)), "")
    status = (
        "finished"
        if (run_dir / "summary.json").exists()
        else "failed"
        if last_event in ("failure", "gave_up")
        else "unfinished"
    )
    try:
        flops = accounting.run_train(config_from_dict(saved["config"]))["train_flops"]
    except Exception:  # noqa: BLE001 - a config of an older layout: the page still shows its records
        flops = None
    info = {
        "dir": rel,
        "page": run_page_name(prefix, run_dir),
        "name": saved["config"].get("name") or rel,
        "status": status,
        "steps": tr[-1]["step"] if tr else 0,
        "planned": planned,
        "tokens": tr[-1]["tokens"] if tr else 0,
        "final_loss": tr[-1]["loss"] if tr else None,
        "final_eval": ev[-1]["loss"].get("macro") if ev and isinstance(ev[-1].get("loss"), dict) else None,
        "eval_step": ev[-1]["step"] if ev else None,
        "flops": flops,
        "hash": saved.get("hash", ""),
    }
    return info, saved, events


def run_page(prefix: Path, run_dir: Path) -> tuple[str, dict]:
    """A plain run's page (its figures, its evaluations, config and timeline) and its index row."""
    rel = _rel(prefix, run_dir)
    info, saved, events = _run_records(prefix, run_dir)
    planned, status, flops = info["planned"], info["status"], info["flops"]
    started = next((e.get("time") for e in events if e.get("event") == "launch"), None)
    final = "-" if info["final_loss"] is None else f"{info['final_loss']:.6g}"
    held = "-" if info["final_eval"] is None else f"{info['final_eval']:.4f} at step {info['eval_step']}"
    body = [
        f"<p><a href='index.html'>all experiments and runs</a></p><h1>Run {E(rel)}</h1>",
        f"<p class=muted>config {E(str(info['name']))}, hash <code>{E(str(info['hash']))}</code>"
        + (f", launched {_when(started)}" if started else "")
        + "</p>",
        "<table><tr><th>status</th><th>steps</th><th>tokens</th><th>final train loss</th>"
        "<th>held-out loss (macro)</th><th>training FLOPs</th></tr>",
        f"<tr><td>{E(status)}</td><td>{info['steps']} of {E(str(planned))}</td><td>{info['tokens']:,}</td>"
        f"<td id=final-loss>{final}</td><td>{held}</td><td>{'-' if flops is None else format(flops, '.3g')}</td>"
        "</tr></table>",
    ]
    health = run_dir / "health.json"
    if health.exists():
        body.append(_health_section(rel, json.loads(health.read_text()), []))
    plots = run_plots(run_dir)
    if plots:
        body.append("<h2>Plots</h2><div class=plots>")
        body.extend(f"<div class='plot' id='run-{k}'>{svg}</div>" for k, svg in plots)
        body.append("</div>")
    body.append(_after_training(run_dir))
    body.append(f"<h2>Configuration</h2><details><summary>config.json</summary><pre>"
                f"{E(json.dumps(saved['config'], indent=1, sort_keys=True))}</pre></details>")  # fmt: skip
    if events:
        body.append("<h2>Timeline</h2>" + _timeline(events))
    return _page(f"run {rel}", "".join(body)), info


def build_site(prefix: Path, out: Path) -> Path:
    """Write index.html, one page per experiment and one per plain run; returns the index's path."""
    out.mkdir(parents=True, exist_ok=True)
    journals, runs = find_records(prefix)
    rows = []
    for journal_path in journals:
        page, info = experiment_page(journal_path.parents[2], journal_path)
        (out / f"{info['name']}.html").write_text(page)
        v = info["verdict"] or "-"
        late = "".join(f"<br><span class=posthoc>{E(x)}</span>" for x in info["post_hoc"])
        rows.append(
            f"<tr><td><a href='{E(info['name'])}.html'>{E(info['title'])}</a></td><td>{E(info['status'])}</td>"
            f"<td class='{E(info['verdict_class'])}'>{E(v)}{late}</td><td>{info['compute']:.3g}</td></tr>"
        )
    run_rows = []
    for run_dir in runs:
        page, info = run_page(prefix, run_dir)
        (out / info["page"]).write_text(page)
        loss = "-" if info["final_loss"] is None else f"{info['final_loss']:.4f}"
        held = "-" if info["final_eval"] is None else f"{info['final_eval']:.4f}"
        flops = "-" if info["flops"] is None else f"{info['flops']:.3g}"
        run_rows.append(
            f"<tr><td><a href='{E(info['page'])}'>{E(info['dir'])}</a></td><td>{E(str(info['name']))}</td>"
            f"<td>{E(info['status'])}</td><td>{info['steps']} of {E(str(info['planned']))}</td><td>{loss}</td>"
            f"<td>{held}</td><td>{flops}</td></tr>"
        )
    body = ["<h1>moelab experiments and runs</h1>"]
    if rows:
        body.append(
            "<h2>Experiments</h2><table><tr><th>experiment</th><th>status</th><th>verdict</th>"
            "<th>training FLOPs spent</th></tr>" + "".join(rows) + "</table>"
        )
    if run_rows:
        body.append(
            "<h2>Runs</h2><table><tr><th>run</th><th>config</th><th>status</th><th>steps</th>"
            "<th>final train loss</th><th>held-out loss (macro)</th><th>training FLOPs</th></tr>"
            + "".join(run_rows)
            + "</table>"
        )
    if not rows and not run_rows:
        body.append(f"<p>No experiments or runs under {E(str(prefix))} yet.</p>")
    index = out / "index.html"
    index.write_text(_page("moelab experiments and runs", "".join(body)))
    return index
