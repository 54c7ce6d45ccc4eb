"""The manual cannot rot: it builds strictly, its generated pages are current, and its examples run.

Every ```bash block of the README and of docs/ runs in a fresh folder, a page's blocks in order (a
block titled ``title="NAME"`` is written to NAME first, so a page can show a config and then use it).
``<!-- docs: slow -->`` before a block runs it only with the slow tests; ``<!-- docs: skip (why) -->``
never (a cluster, a GPU). A shown output is compared: ``<!-- docs: output -->`` before a ```text block
says it is what the bash block before it printed, and each of its lines must appear, in order, in
what that block prints now (``...`` stands for anything; a whole number matches as shown, a decimal
within 5% or one unit of its last shown digit, so losses and ratios may move a little). Every other
```text block says what it is instead (``<!-- docs: shown (a layout, not an output) -->``). The
conventions are in docs/index.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
SHELLS = {"sh", "shell", "console", "bash", "zsh"}
MARK = re.compile(r"<!--\s*docs:\s*(slow|skip|output|shown)\b(.*?)-->")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)(.*)$")
TITLE = re.compile(r'title="([^"]+)"')


@dataclass
class Block:
    page: str
    line: int
    lang: str
    title: str
    mark: str  # "", "slow" or "skip"; for a text block "output" (compared) or "shown" (not an output)
    reason: str
    code: str


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the mark on the line before each."""
    lines = path.read_text().splitlines()
    out, i, prev = [], 0, ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                prev = lines[i]
            i += 1
            continue
        indent, fence, lang, rest = m.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        mark = MARK.search(prev)
        t = TITLE.search(rest)
        out.append(
            Block(
                page=str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name,
                line=start + 1,
                lang=lang.lower(),
                title=t.group(1) if t else "",
                mark=mark.group(1) if mark else "",
                reason=mark.group(2).strip(" ()") if mark else "",
                code="\n".join(body) + "\n",
            )
        )
        prev, i = "", i + 1
    return out


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def runnable(path: Path, slow: bool) -> list[Block]:
    return [b for b in blocks(path) if b.lang == "bash" and b.mark != "skip" and (slow or b.mark != "slow")]


def _line_pattern(shown: str) -> tuple[re.Pattern, list[str]]:
    """A shown output line as a pattern: its words as written (any run of spaces for spaces, ``...`` for
    anything), each number a group; and the numbers as shown."""
    parts, numbers, pos = [], [], 0

    def literal(text: str) -> str:
        return ".*?".join(r"\s+".join(re.escape(w) for w in piece.split(" ")) for piece in text.split("..."))

    for m in NUMBER.finditer(shown):
        parts += [literal(shown[pos : m.start()]), r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"]
        numbers.append(m.group())
        pos = m.end()
    parts.append(literal(shown[pos:]))
    return re.compile("".join(parts)), numbers


def _close(shown: str, got: str) -> bool:
    """A whole number as shown; a decimal within 5% or one unit of its last shown digit."""
    want, have = float(shown), float(got)
    if not re.search(r"[.eE]", shown):
        return have == want
    digits = len(re.split(r"[eE]", shown)[0].partition(".")[2])
    return abs(have - want) <= max(0.05 * abs(want), 10.0**-digits)


def output_mismatch(shown: str, printed: str) -> str | None:
    """The first shown line (a ``$ command`` line aside) that does not appear, in order, in ``printed``."""
    lines = [" ".join(x.split()) for x in printed.splitlines() if x.strip()]
    at = 0
    for raw in shown.splitlines():
        text = " ".join(raw.split())
        if not text or text == "..." or text.startswith("$ "):
            continue
        pattern, numbers = _line_pattern(text)
        for i in range(at, len(lines)):
            m = pattern.fullmatch(lines[i])
            if m and all(_close(n, g) for n, g in zip(numbers, m.groups(), strict=True)):
                at = i + 1
                break
        else:
            return text
    return None


def run_page(path: Path, folder: Path, slow: bool) -> None:
    """Run a page's blocks in order in ``folder``; fail naming the block, its line and its output, or a
    shown output (``docs: output``) that is not what the block before it printed."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "MOELAB_PROGRESS_EVERY": "1000"}
    env.pop("COLUMNS", None)
    printed = None  # what the last bash block printed (None: it did not run here)
    for b in blocks(path):
        if b.title:
            target = folder / b.title
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.code)
        if b.lang == "text" and b.mark == "output" and printed is not None:
            missing = output_mismatch(b.code, printed)
            assert missing is None, (
                f"{b.page}:{b.line}: the shown output is not what the block before it prints now; this line "
                f"is not in it:\n{missing}\n--- printed\n{printed[-3000:]}"
            )
        if b.lang != "bash":
            continue
        printed = None
        if b.mark == "skip" or (b.mark == "slow" and not slow):
            continue
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", b.code],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream, in the order a terminal shows it
            text=True,
            timeout=1800 if slow else 120,
        )
        assert proc.returncode == 0, (
            f"{b.page}:{b.line}: the block exited {proc.returncode}\n{b.code}\n--- output\n{proc.stdout[-4000:]}"
        )
        printed = proc.stdout


def test_blocks_parse_marks_and_titles(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "Intro\n\n<!-- docs: slow -->\n```bash\nmoelab train tiny\n```\n\n"
        '```yaml title="a.yaml"\nbase: tiny\n```\n\n<!-- docs: skip (a cluster) -->\n```bash\nsrun x\n```\n'
        "```text\nout\n```\n\n```bash\necho hi\n```\n"
    )
    # parsed as written by hand: four blocks, the marks on the line before, the title on the fence
    got = [(b.line, b.lang, b.title, b.mark, b.reason, b.code) for b in blocks(page)]
    assert got == [
        (4, "bash", "", "slow", "", "moelab train tiny\n"),
        (8, "yaml", "a.yaml", "", "", "base: tiny\n"),
        (13, "bash", "", "skip", "a cluster", "srun x\n"),
        (16, "text", "", "", "", "out\n"),
        (20, "bash", "", "", "", "echo hi\n"),
    ]
    assert [b.code for b in runnable(page, slow=False)] == ["echo hi\n"]
    assert [b.code for b in runnable(page, slow=True)] == ["moelab train tiny\n", "echo hi\n"]


def test_a_failing_block_fails_naming_page_and_line(tmp_path):
    page = tmp_path / "p.md"
    page.write_text('```text title="x.txt"\nhello\n```\n\n```bash\ngrep -q hello x.txt\nfalse\n```\n')
    with pytest.raises(AssertionError, match=r"p.md:5: the block exited 1"):
        run_page(page, tmp_path, slow=False)
    assert (tmp_path / "x.txt").read_text() == "hello\n"


def test_every_shell_block_is_bash_and_every_skip_says_why():
    """A shell block in another fence (sh, console) would escape the runner; a skip must give its reason."""
    for path in pages():
        for b in blocks(path):
            assert b.lang not in SHELLS - {"bash"}, f"{b.page}:{b.line}: shell blocks are ```bash (run by this test)"
            if b.mark == "skip":
                assert b.reason, f"{b.page}:{b.line}: <!-- docs: skip (why) --> needs its reason"


def test_a_shown_output_is_compared_with_what_the_block_prints(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "```bash\nprintf 'loss 4.1234 at step 60\\nrun abc12 took 10.2 s\\nratio 0.957\\n'\n```\n\n"
        "<!-- docs: output -->\n```text\nloss 4.12 at step 60\nrun abc12 took ... s\n```\n"
    )
    run_page(page, tmp_path, slow=False)  # numbers as shown, within 5%; ... for anything
    assert output_mismatch("ratio 0.957", "ratio 0.93") is None  # 2.8% off: a number may move a little
    assert output_mismatch("ratio 0.957", "ratio 0.85") == "ratio 0.957"  # 11% off: not what it prints
    assert output_mismatch("a\nb", "b\na") == "b"  # in order
    assert output_mismatch("run abc12", "run abc13") == "run abc12"  # words as written
    page.write_text(page.read_text().replace("4.12 at step 60", "4.12 at step 61"))
    with pytest.raises(AssertionError, match=r"p.md:6: the shown output is not what the block before it prints"):
        run_page(page, tmp_path, slow=False)


def test_every_text_block_is_a_compared_output_or_says_what_it_is():
    """A ```text block in the README or a guide is the output of the block before it (compared) or says
    what else it is; the reference pages are generated from the code and checked apart."""
    for path in pages():
        if "reference" in path.parts:
            continue
        for b in blocks(path):
            if b.lang == "text":
                assert b.mark in ("output", "shown"), (
                    f"{b.page}:{b.line}: mark a shown output <!-- docs: output --> (compared with what the "
                    "block before it prints) or say what it is: <!-- docs: shown (what) -->"
                )
                assert b.mark == "output" or b.reason, f"{b.page}:{b.line}: <!-- docs: shown (what) --> says what"


FAST = [p for p in pages() if runnable(p, slow=False)]
ALL = [p for p in pages() if runnable(p, slow=True)]


@pytest.mark.parametrize("path", FAST, ids=[str(p.relative_to(ROOT)) for p in FAST])
def test_quick_examples_run(path, tmp_path):
    run_page(path, tmp_path, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("path", ALL, ids=[str(p.relative_to(ROOT)) for p in ALL])
def test_all_examples_run(path, tmp_path):
    run_page(path, tmp_path, slow=True)


def test_results_pages_are_what_the_benchmarks_wrote():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "results_pages.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_manual_builds_strictly(tmp_path):
    """mkdocs --strict: a broken link, a missing page or anchor, a page left out of the nav fails."""
    if shutil.which("mkdocs", path=str(BIN)) is None:
        pytest.fail("mkdocs is not installed: pip install -c requirements.lock -e '.[dev]'")
    proc = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "config.html").exists()


def test_results_page_renders_figures_as_written():
    """A small result rendered by hand: scalars as field rows, a mapping of records as one table."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results_pages as rp
    finally:
        sys.path.pop(0)
    out: list[str] = []
    rp.render(
        {"steps": 1200, "ratio": 0.87752, "runs": {"a": {"loss": 3.41, "tok_s": 18600}, "b": {"loss": 3.5}}}, 2, out
    )
    assert "\n".join(out) == (
        "| field | value |\n|---|---|\n| steps | 1,200 |\n| ratio | 0.8775 |\n\n### runs\n\n"
        "|  | loss | tok_s |\n|---|---|---|\n| a | 3.41 | 18,600 |\n| b | 3.5 |  |\n"
    )
    assert rp.fmt(1.5e-5) == "1.5e-05" and rp.fmt(True) == "true" and rp.fmt(None) == "-"


def test_a_plot_goes_on_its_own_results_page_only(tmp_path):
    """forecast_tokens.svg is the forecast_tokens result's plot, never the forecast result's (whose name
    prefixes it); a plot with a suffix of its own (memory_plan_a.svg) stays with its result."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results_pages as rp
    finally:
        sys.path.pop(0)
    for name in ("forecast", "forecast_tokens", "memory_plan"):
        (tmp_path / f"{name}.json").write_text("{}")
    for plot in ("forecast_tokens", "memory_plan_a", "forecast"):
        (tmp_path / f"{plot}.svg").write_text("<svg/>")
    assert [p.name for p in rp.plots_of("forecast", tmp_path)] == ["forecast.svg"]
    assert [p.name for p in rp.plots_of("forecast_tokens", tmp_path)] == ["forecast_tokens.svg"]
    assert [p.name for p in rp.plots_of("memory_plan", tmp_path)] == ["memory_plan_a.svg"]


def test_the_speed_page_shows_every_measured_figure_beside_its_target():
    """docs/results/speed.md (benchmarks/speed_page.py): each shape's ratio, each writer's ratio and
    each cold process's first step, as the results files hold them, each said met or missed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import speed_page
    finally:
        sys.path.pop(0)
    text = speed_page.speed_page()
    results = ROOT / "benchmarks" / "results"
    rows = 0
    for name in ("vs_transformers", "vs_transformers_cd"):
        path = results / f"{name}.json"
        if not path.exists():
            continue
        for shape, r in json.loads(path.read_text())["shapes"].items():
            verdict = "met" if r["ratio"] >= 1.0 else "missed"
            line = next(x for x in text.splitlines() if x.startswith(f"| {shape} |") and "huge pages" in x)
            assert f"**{r['ratio']:.2f}x** ({verdict})" in line, line
            rows += 1
    assert rows >= 2  # shapes A and B at least
    ck = json.loads((results / "checkpoint_async.json").read_text())
    for w, f in ck["writers"].items():
        verdict = "met" if f["ratio"] <= ck["target_ratio"] else "missed"
        assert f"| {w} | **{f['ratio']:.2f}x** ({verdict}) |" in text
    cold = json.loads((results / "cold_start.json").read_text())
    for kind, by in cold["results"].items():
        assert f"| {kind} | **{by['now']['first_step_s']:.1f} s** (" in text
    assert text.count("Predictions: `") == 3  # each section names its registered predictions


def test_readme_links_reach_files():
    """The README is read on GitHub, outside the mkdocs build: its relative links must reach files."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links to the manual"
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
