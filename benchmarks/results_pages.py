"""The manual's measured results, written from what the benchmarks wrote: docs/results/.

Every benchmark here writes benchmarks/results/<name>.json with its date and machine; this script
renders each into docs/results/<name>.md (its purpose from the script's own docstring, the command that
measures it, the date and machine, every figure as a table, its plot, and the prediction registered
before it ran, outcome included), and docs/results/index.md listing them by date. No figure is typed
by hand: rerun a benchmark, then this script (`make bench` and `make docs` both do), and the pages
follow. `--check` exits 1 naming the pages that differ from what it would write (tests/test_docs.py).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOCS = ROOT / "docs" / "results"
MAX_ROWS = 40
MAX_COLS = 12
MAX_DEPTH = 5  # headings below this depth are named, not expanded (the JSON holds them)


def fmt(v) -> str:
    """A scalar as a table cell: ints with separators, floats to 4 significant figures."""
    if isinstance(v, bool) or v is None:
        return str(v).lower() if isinstance(v, bool) else "-"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e7 or abs(v) < 1e-3):
            return f"{v:.4g}"
        return f"{v:,.4g}" if abs(v) >= 1000 else f"{v:.4g}"
    text = str(v).replace("|", "\\|").replace("\n", " ")
    return text


def is_scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def short_list(v) -> bool:
    return isinstance(v, list) and len(v) <= 8 and all(is_scalar(x) for x in v)


def cell(v) -> str:
    if short_list(v):
        return ", ".join(fmt(x) for x in v)
    if isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) and v:
        return f"{len(v)} values, {fmt(min(v))} to {fmt(max(v))}"
    if isinstance(v, list) and all(is_scalar(x) for x in v):
        return f"{len(v)} values: " + ", ".join(fmt(x) for x in v[:8]) + ", ..."
    return fmt(v)


def flat(v) -> bool:
    """Shown in one cell: a scalar, a list of scalars."""
    return is_scalar(v) or (isinstance(v, list) and all(is_scalar(x) for x in v))


def table(rows: list[tuple[str, dict]], first: str) -> list[str]:
    cols: list[str] = []
    for _, r in rows:
        for k, v in r.items():
            if flat(v) and k not in cols:
                cols.append(k)
    cut = cols[MAX_COLS:]
    cols = cols[:MAX_COLS]
    out = ["| " + " | ".join([first, *(fmt(c) for c in cols)]) + " |", "|" + "---|" * (len(cols) + 1)]
    for name, r in rows[:MAX_ROWS]:
        out.append("| " + " | ".join([fmt(name), *(cell(r[c]) if c in r else "" for c in cols)]) + " |")
    if len(rows) > MAX_ROWS:
        out.append(f"\n{len(rows) - MAX_ROWS} more rows in the JSON.")
    if cut:
        out.append(f"\nColumns not shown (in the JSON): {', '.join(cut)}.")
    return out + [""]


def tabular(d: dict) -> bool:
    """A mapping of records: each value a mapping with flat fields (rows of one table)."""
    return (
        len(d) >= 2
        and all(isinstance(v, dict) for v in d.values())
        and all(sum(flat(x) for x in v.values()) >= max(1, len(v) // 2) for v in d.values())
    )


def render(obj, depth: int, out: list[str]) -> None:
    if isinstance(obj, list):
        if obj and all(isinstance(x, dict) for x in obj):
            out += table([(str(i), x) for i, x in enumerate(obj)], "#")
            nested = [k for x in obj for k, v in x.items() if not flat(v)]
            if nested:
                out.append(f"Nested fields not shown (in the JSON): {', '.join(dict.fromkeys(nested))}.\n")
        else:
            out.append(cell(obj) + "\n")
        return
    if not isinstance(obj, dict):
        out.append(fmt(obj) + "\n")
        return
    scal = {k: v for k, v in obj.items() if flat(v)}
    if scal:
        out += ["| field | value |", "|---|---|", *(f"| {fmt(k)} | {cell(v)} |" for k, v in scal.items()), ""]
    for k, v in obj.items():
        if flat(v):
            continue
        if depth >= MAX_DEPTH:
            out.append(f"**{fmt(k)}**: in the JSON.\n")
            continue
        out.append(f"{'#' * (depth + 1)} {fmt(k)}\n")
        if isinstance(v, dict) and tabular(v):
            out += table(list(v.items()), "")
            nested = list(dict.fromkeys(kk for r in v.values() for kk, vv in r.items() if not flat(vv)))
            rest = []
            for nk in nested:
                subs = {name: r[nk] for name, r in v.items() if nk in r}
                if all(isinstance(x, dict) and x and all(flat(y) for y in x.values()) for x in subs.values()):
                    # the same breakdown for each record: its parts as rows, the records as columns
                    keys = list(dict.fromkeys(kk for x in subs.values() for kk in x))
                    out.append(f"{'#' * (depth + 2)} {fmt(k)}: {fmt(nk)}\n")
                    out += table([(kk, {name: x.get(kk) for name, x in subs.items()}) for kk in keys], "")
                else:
                    rest.append(nk)
            for name, r in v.items():
                deeper = {kk: vv for kk, vv in r.items() if kk in rest}
                if deeper and depth + 1 < MAX_DEPTH:
                    out.append(f"{'#' * (depth + 2)} {fmt(k)}: {fmt(name)}\n")
                    render(deeper, depth + 2, out)
        else:
            render(v, depth + 1, out)


def purpose(name: str) -> str:
    """The benchmark's docstring (its first paragraph), or '' when no script of that name exists."""
    script = HERE / f"{name}.py"
    if not script.exists():
        return ""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def machine(d: dict) -> str:
    m = d.get("machine") or d.get("host") or ""
    if isinstance(m, dict):
        m = ", ".join(f"{k} {v}" for k, v in m.items() if is_scalar(v))
    if d.get("cpus"):
        m = f"{m}, {d['cpus']} cores" if m else f"{d['cpus']} cores"
    return str(m) or "not recorded"


def script_of(name: str) -> str:
    """The benchmark that writes results/<name>.json: the script of that name, else the one naming the file."""
    if (HERE / f"{name}.py").exists():
        return f"{name}.py"
    for script in sorted(HERE.glob("*.py")):
        if f"{name}.json" in script.read_text():
            return script.name
    return ""


def owner(plot: str, names) -> str | None:
    """The result a plot belongs to: the longest result name that is the plot's name or its prefix up to
    an underscore (forecast_tokens.svg is forecast_tokens', not forecast's; memory_plan.svg memory_plan's)."""
    mine = [n for n in names if plot == n or plot.startswith(n + "_")]
    return max(mine, key=len) if mine else None


def plots_of(name: str, results: Path = RESULTS) -> list[Path]:
    names = [p.stem for p in results.glob("*.json")]
    return [svg for svg in sorted(results.glob(f"{name}*.svg")) if owner(svg.stem, names) == name]


def page(name: str, d) -> tuple[str, list[Path]]:
    """The page for results/<name>.json and the files (plots) it shows."""
    info = d if isinstance(d, dict) else {}
    script = script_of(name)
    out = [f"# {name.replace('_', ' ')}\n"]
    what = purpose(Path(script).stem) if script else ""
    if what:
        out.append(what + "\n")
    cmd = info.get("command") or (f"python benchmarks/{script}" if script else "")
    out += [
        "| | |",
        "|---|---|",
        f"| measured | {fmt(info.get('date', 'not recorded'))} |",
        f"| machine | {fmt(machine(info))} |",
        f"| command | `{cmd}` |" if cmd else "| command | not recorded |",
        f"| figures | `benchmarks/results/{name}.json` |",
        "",
    ]
    shown = []
    for svg in plots_of(name):
        out.append(f"![{svg.stem}]({svg.name})\n")
        shown.append(svg)
    out.append("## Figures\n")
    body = {k: v for k, v in info.items() if k not in ("date", "machine", "command", "host", "cpus")} if info else d
    render(body, 2, out)
    for pred in sorted(RESULTS.glob(f"{name}_prediction*.md")):
        out.append(f"## Registered prediction: `{pred.name}`\n")
        text = pred.read_text().strip()
        # its headings sit under this one
        text = "\n".join("##" + line if line.startswith("#") else line for line in text.splitlines())
        out.append(text + "\n")
    return "\n".join(out).rstrip() + "\n", shown


def pages() -> dict[str, str | Path]:
    """Every file of docs/results/: name -> Markdown text, or the plot's source path."""
    files: dict[str, str | Path] = {}
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        d = json.loads(path.read_text())
        text, plots = page(path.stem, d)
        files[f"{path.stem}.md"] = text
        for svg in plots:
            files[svg.name] = svg
        date = d.get("date", "") if isinstance(d, dict) else ""
        what = purpose(Path(script_of(path.stem)).stem) if script_of(path.stem) else ""
        rows.append((date, path.stem, what.split(". ")[0].rstrip(".")))
    index = [
        "# Measured results\n",
        "Every figure in this manual comes from a script in `benchmarks/` that writes it, with the date",
        "and the machine, to `benchmarks/results/<name>.json`; these pages are written from those files by",
        "`benchmarks/results_pages.py` (`make docs`), so none is typed by hand. A registered prediction",
        "(written and committed before the benchmark ran) is shown on its page with its outcome.",
        "`make bench` reruns them all.\n",
        "| measured | result | what it measures |",
        "|---|---|---|",
    ]
    for date, stem, what in sorted(rows, key=lambda r: (r[0], r[1]), reverse=True):
        index.append(f"| {date} | [{stem.replace('_', ' ')}]({stem}.md) | {fmt(what)} |")
    # issue 42's figures together, each with its target and prediction
    from speed_page import speed_page

    files["speed.md"] = speed_page()
    index.insert(6, "The speed figures together, each beside its target and prediction: [Speed](speed.md).\n")
    files["index.md"] = "\n".join(index) + "\n"
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 naming the pages that are not what this writes")
    ap.add_argument("--out", type=Path, default=DOCS, help="the folder to write (default docs/results)")
    args = ap.parse_args(argv)
    want = pages()
    if args.check:
        stale = []
        for name, content in want.items():
            have = args.out / name
            data = content.read_bytes() if isinstance(content, Path) else content.encode()
            if not have.exists() or have.read_bytes() != data:
                stale.append(name)
        extra = sorted(p.name for p in args.out.glob("*") if p.name not in want) if args.out.exists() else []
        if stale or extra:
            print(
                f"docs/results is stale ({', '.join(stale + extra)}): run python benchmarks/results_pages.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    for name, content in want.items():
        if isinstance(content, Path):
            shutil.copyfile(content, args.out / name)
        else:
            (args.out / name).write_text(content)
    print(f"wrote {len(want)} files to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
