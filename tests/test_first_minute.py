"""benchmarks/first_minute.py's phase parser on recorded stderr lines, and MOELAB_TIMING=1's lines it reads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from moelab import progress

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fm():
    spec = importlib.util.spec_from_file_location("first_minute", ROOT / "benchmarks" / "first_minute.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["first_minute"] = mod
    spec.loader.exec_module(mod)
    return mod


def _mark(t: float, name: str, cpu: float) -> tuple[float, str]:
    return (t, f"moelab: timing: {name} at {t - 0.05:.2f} s, cpu {cpu:.2f} s")


# a warm 2-step run's stderr as benchmarks/first_minute.py stamps it (seconds since the process started)
LOG = [
    _mark(1.50, "fit check", 1.00),
    _mark(1.60, "start-up", 1.05),  # the training modules' imports after the fit check
    _mark(2.00, "store check", 1.30),
    _mark(2.30, "state", 1.50),
    (2.31, "moelab: building the model and optimiser state"),
    _mark(3.00, "launch", 1.90),
    _mark(3.00, "peak", 1.90),
    (3.01, "moelab: this machine's float32 matmul peak, for MFU (measured once a week)"),
    _mark(3.10, "launch", 1.95),
    _mark(3.20, "initial eval", 2.00),
    _mark(3.25, "compile", 2.02),
    (3.26, "moelab: compiling the train step (step 1 waits for it; the XLA cache keeps it for reruns)"),
    _mark(5.25, "steps", 3.50),
    (5.26, "train: step 1/2 (50%)"),
    _mark(5.30, "eval", 3.52),
    _mark(6.30, "steps", 4.80),
    (6.69, "train: step 2/2 (100%)"),
    _mark(6.70, "final eval", 5.10),
    _mark(7.70, "checkpoint", 6.30),
    _mark(7.75, "steps", 6.33),
    _mark(7.75, "checkpoint", 6.33),
    _mark(7.80, "summary", 6.35),
    _mark(7.90, "exit", 6.40),
]
TOTAL, CPU_TOTAL = 8.20, 6.60  # the process's end, stamped outside it

# by hand: each mark to the next, a name opened again added up; start-up from the process's start
WALL = {"start-up": 1.50 + 0.40, "fit check": 0.10, "store check": 0.30, "state": 0.70, "launch": 0.10,
        "peak": 0.10, "initial eval": 0.05, "compile": 2.00, "steps": 0.05 + 0.40, "eval": 1.00,
        "final eval": 1.00, "checkpoint": 0.05 + 0.05, "summary": 0.10, "exit": 0.30}  # fmt: skip
CPU = {"start-up": 1.00 + 0.25, "fit check": 0.05, "store check": 0.20, "state": 0.40, "launch": 0.05,
       "peak": 0.05, "initial eval": 0.02, "compile": 1.48, "steps": 0.02 + 0.30, "eval": 1.28,
       "final eval": 1.20, "checkpoint": 0.03 + 0.02, "summary": 0.05, "exit": 0.20}  # fmt: skip


def test_every_phase_of_the_second_command_from_its_lines(fm):
    got = fm.process_phases(LOG, TOTAL, CPU_TOTAL)
    assert list(got["wall"]) == fm.PHASES == list(WALL)
    assert got["wall"] == pytest.approx(WALL, abs=1e-9)
    assert got["cpu"] == pytest.approx(CPU, abs=1e-9)
    assert sum(got["wall"].values()) == pytest.approx(TOTAL)  # the phases cover the process, start to exit
    assert sum(got["cpu"].values()) == pytest.approx(CPU_TOTAL)


def test_a_log_without_the_marks_or_with_a_stranger_is_refused(fm):
    with pytest.raises(ValueError, match="MOELAB_TIMING=1"):
        fm.process_phases(LOG[:-1], TOTAL)  # no exit: the process was not run with MOELAB_TIMING=1, or died
    with pytest.raises(ValueError, match="unknown phase 'warmup'"):
        fm.process_phases([_mark(1.0, "warmup", 0.5), *LOG], TOTAL)


def test_the_lines_moelab_prints_are_the_lines_the_parser_reads(fm, monkeypatch, capsys):
    monkeypatch.setenv(progress.TIMING_ENV, "1")
    monkeypatch.setattr(progress, "_phases", [])
    for name in fm.PHASES[1:]:
        progress.phase(name)
        progress.phase(name)  # still in it: no second line
    err = capsys.readouterr().err.splitlines()
    marks = [line for line in err if line.startswith(fm.MARK)]
    assert len(marks) == len(fm.PHASES) - 1
    got = fm.process_phases([(float(i), line) for i, line in enumerate(err)], float(len(err)))
    assert set(got["wall"]) == set(fm.PHASES) and got["wall"]["exit"] >= 0
    table = err[err.index(marks[-1]) + 1 :]  # exit's table: each phase's wall and CPU seconds
    assert table[0].startswith("moelab: seconds per phase") and [r.split()[0] for r in table[1:3]] == [
        "start-up",
        "fit",
    ]


def test_timing_is_silent_unless_asked(monkeypatch, capsys):
    monkeypatch.delenv(progress.TIMING_ENV, raising=False)
    monkeypatch.setattr(progress, "_phases", [])
    progress.phase("state")
    progress.phase("exit")
    assert capsys.readouterr().err == "" and progress._phases == []
