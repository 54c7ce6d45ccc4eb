"""Generation tasks (issue 41, item 4): the task file, pass@k against its definition, and the sandbox's
limits: time, memory, a scratch folder, no network, every process it started killed."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import socket
import subprocess
import time

import pytest

from moelab.errors import UsageError
from moelab.eval import generation as G


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k by its definition: the share of the k-subsets of n samples (c passing) holding a pass."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass():
    assert G.pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c / n
    assert G.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert G.pass_at_k(5, 0, 3) == 0.0 and G.pass_at_k(5, 3, 3) == 1.0  # n - c < k: always a pass
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 10)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert G.pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        G.pass_at_k(3, 4, 1)


def _write(tmp_path, lines, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_task_files_of_each_kind_and_their_checks(tmp_path):
    path = _write(tmp_path, [
        {"prompt": "def add(a, b):\n", "tests": "assert add(2, 3) == 5", "name": "add"},
        "",
        {"prompt": "2 + 2 =", "target": "4"},
        {"prompt": "a year:", "regex": r"\b(19|20)\d\d\b"},
    ])  # fmt: skip
    add, four, year = G.load_gen_tasks(path)
    assert (add.name, add.kind, four.name, four.kind, year.kind) == ("add", "tests", "tasks/3", "target", "regex")
    box = G.Sandbox(timeout=20)
    assert G.check(add, "    return a + b\n", box) and not G.check(add, "    return a - b\n", box)
    assert G.check(four, " 4 \n") and not G.check(four, "44")
    assert G.check(year, "in 1969, then") and not G.check(year, "in 969")
    res = G.score([four, year], [["4", "5", " 4"], ["1999", "x", "y"]], ks=(1, 2, 3))
    assert res["passed"] == {"tasks/3": 2, "tasks/4": 1}
    assert res["pass@1"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert res["pass@3"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "line,says",
    [
        ("{not json", "not a JSON object"),
        ('["a list"]', "a task is a JSON object"),
        ('{"target": "x"}', 'no "prompt" string'),
        ('{"prompt": "p"}', "exactly one check of tests, target, regex (got none)"),
        ('{"prompt": "p", "target": "x", "regex": "y"}', "(got target, regex)"),
        ('{"prompt": "p", "tests": 3}', '"tests" must be a string'),
        ('{"prompt": "p", "regex": "(["}', '"regex" is not a regular expression'),
    ],
)
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, line, says):
    path = _write(tmp_path, [{"prompt": "fine", "target": "x"}, line])
    with pytest.raises(UsageError) as err:
        G.load_gen_tasks(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:2: ") and says in msg and "\n" not in msg


def test_the_sandbox_passes_on_exit_0_and_keeps_to_its_scratch_folder(tmp_path):
    box = G.Sandbox(timeout=20)
    out = box.run("import os\nopen('made.txt', 'w').write('x')\nprint(os.getcwd())\n")
    assert out.passed and out.returncode == 0
    scratch = out.output.strip()
    assert scratch != os.getcwd() and "moelab-sandbox-" in scratch and not os.path.exists(scratch)  # removed
    failed = box.run("assert 1 == 2, 'wrong'\n")
    assert not failed.passed and failed.returncode == 1 and "AssertionError: wrong" in failed.output


def test_namespaces_are_used_where_the_machine_makes_them():
    """Where ``unshare`` makes a user namespace at all, the sandbox's whole set-up works there: the scratch
    folder writable, every other folder read-only (else the sandbox falls back to the audit hook)."""
    try:
        basic = subprocess.run(["unshare", "-rnmpf", "true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        basic = False
    assert G._namespaces() == basic


MODES = [pytest.param(True, id="namespaces"), pytest.param(False, id="audit-hook")]


def _box(namespaces: bool, **kw) -> G.Sandbox:
    if namespaces and not G._namespaces():
        pytest.skip("this machine makes no user namespace")  # the audit-hook case runs everywhere
    return G.Sandbox(namespaces=namespaces, **kw)


def _running(marker: str) -> list[int]:
    """The processes on this machine whose command line holds ``marker``."""
    found = []
    for d in os.scandir("/proc"):
        try:
            if d.name.isdigit() and marker in open(f"/proc/{d.name}/cmdline", "rb").read().decode(errors="replace"):
                if open(f"/proc/{d.name}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(d.name))
        except OSError:
            pass
    return found


def _sleeper(marker: str) -> str:
    """A program that starts a child that sleeps ``marker`` seconds (none where a new process is refused)."""
    return f"import subprocess\ntry:\n    subprocess.Popen(['sleep', {marker!r}])\nexcept PermissionError:\n    pass\n"


@pytest.mark.parametrize("namespaces", MODES)
def test_the_sandbox_stops_a_program_at_its_time_limit_with_every_process_it_started(namespaces):
    marker = f"300.{time.monotonic_ns() % 10**9:09d}"  # a unique duration: the child's mark
    box = _box(namespaces, timeout=3)
    t0 = time.perf_counter()
    out = box.run(_sleeper(marker) + "import time\nwhile True:\n    time.sleep(0.1)\n")  # under the CPU limit
    assert not out.passed and out.returncode is None and time.perf_counter() - t0 < 15
    time.sleep(0.2)
    assert _running(marker) == [] and _running("moelab-sandbox-") == []  # killed with the program, not left behind


@pytest.mark.parametrize("namespaces", MODES)
def test_a_program_that_exits_leaves_nothing_running(namespaces):
    marker = f"300.{time.monotonic_ns() % 10**9:09d}"  # a unique duration: the child's mark
    out = _box(namespaces, timeout=20).run(_sleeper(marker))
    assert out.passed and out.seconds < 15, out  # a child it left does not hold the run to the time limit
    time.sleep(0.2)
    assert _running(marker) == []


@pytest.mark.parametrize("namespaces", MODES)
def test_the_sandbox_kills_a_fork_bomb(namespaces):
    box = _box(namespaces, timeout=4, processes=32)
    if namespaces and box.process_limit is None:
        pytest.skip("root on a machine whose cgroups are not writable: no cap on processes to hold a fork bomb")
    marker = f"moelab-bomb-{os.getpid()}-{time.monotonic_ns()}"
    code = f"import os, sys\nsys.argv.append({marker!r})\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.perf_counter()
    out = box.run(code)
    assert not out.passed and out.returncode is None and time.perf_counter() - t0 < 20
    time.sleep(0.3)
    assert len(os.listdir("/proc")) < 10_000 and _running("moelab-sandbox-") == []  # nothing of it left


@pytest.mark.parametrize("namespaces", MODES)
def test_a_program_cannot_write_outside_its_folder(namespaces, tmp_path):
    outside = tmp_path / "escaped.txt"
    code = (
        "import os, pathlib, shutil\n"
        "open('inside.txt', 'w').write('fine')\nos.mkdir('sub')\n"
        f"target = {str(outside)!r}\n"
        "for attempt in (lambda: open(target, 'w'), lambda: os.open(target, os.O_WRONLY | os.O_CREAT),\n"
        "                lambda: pathlib.Path(target).write_text('x'), lambda: shutil.copy('inside.txt', target),\n"
        "                lambda: os.rename('inside.txt', target), lambda: os.mkdir(target + '.d')):\n"
        "    try:\n        attempt()\n        print('ESCAPED')\n    except OSError as exc:\n        print('refused', exc)\n"
        "os.chdir('/')\n"
        "try:\n    open(target[1:], 'w')\n    print('ESCAPED')\nexcept OSError:\n    print('refused relative')\n"
    )
    out = _box(namespaces, timeout=20).run(code)
    assert out.passed and "ESCAPED" not in out.output and out.output.count("refused") == 7, out.output
    assert list(tmp_path.iterdir()) == []


def test_the_sandbox_holds_a_memory_limit():
    box = G.Sandbox(timeout=20, memory_mb=256)
    out = box.run("x = bytearray(1024 * 1024 * 1024)\n")  # 1 GiB, over the limit
    assert not out.passed and "MemoryError" in out.output
    assert box.run("x = bytearray(16 * 1024 * 1024)\n").passed  # under it


@pytest.mark.parametrize("namespaces", MODES)
def test_the_sandbox_has_no_network(namespaces):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        assert socket.create_connection(("127.0.0.1", port), timeout=5)  # reachable from here
        box = _box(namespaces, timeout=20)
        out = box.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\n")
        assert not out.passed and ("OSError" in out.output or "Error" in out.output), out.output
    finally:
        server.close()
    assert math.isfinite(out.seconds)


# ---------------------------------------------------------------- the built-in code task (doctests)

MODULE = '''
import os

LIMIT = 3


def double(x):
    """Twice x.

    >>> double(4)
    8
    """
    return 2 * x


def capped(x):
    """x, at most LIMIT (reads a module global: not a task).

    >>> capped(9)
    3
    """
    return min(x, LIMIT)


@staticmethod
def decorated(x):
    """>>> decorated(1)
    1
    """
    return x


def only_prints():
    """Its examples hold whatever the body does (`pass` passes them too: not a task).

    >>> only_prints()
    """
    return None


def joined(parts):
    """Imports what it needs itself.

    >>> joined(["a", "b"])
    'a/b'
    """
    import posixpath

    return posixpath.join(*parts)


def no_examples(x):
    """No doctest here."""
    return x
'''


def test_the_doctest_task_maker_keeps_what_its_rule_says(tmp_path):
    from moelab.eval import doctest_tasks as D

    names = [name for name, _, _ in D.candidates(MODULE)]
    assert names == ["double", "only_prints", "joined"]  # capped reads a global; decorated, no_examples: not taken
    name, prompt, solution = D.candidates(MODULE)[0]
    assert prompt.startswith("def double(x):\n") and prompt.endswith('    """\n') and solution == "    return 2 * x\n"
    site = tmp_path / "site" / "pkg"
    site.mkdir(parents=True)
    (site / "mod.py").write_text(MODULE)
    man = D.generate(tmp_path / "out", tmp_path / "site", progress=False)
    rows = [json.loads(x) for x in (tmp_path / "out" / "doctests.jsonl").read_text().splitlines()]
    # only_prints: its body `pass` passes its examples too, so it checks nothing
    assert [r["name"] for r in rows] == ["pkg/mod.py:double", "pkg/mod.py:joined"]
    assert man["tasks"] == 2 and list(man["files"]) == ["pkg/mod.py"]
    tasks = G.load_gen_tasks(tmp_path / "out" / "doctests.jsonl")
    box = G.Sandbox(timeout=20)
    assert G.check(tasks[0], "    return x + x\n", box) and not G.check(tasks[0], "    return x * x\n", box)


def test_the_shipped_doctest_task_holds_what_its_manifest_says():
    """The shipped file loads as generation tasks, each with its doctest runner, and a sample of them:
    the original body passes, an empty one fails (every task, in `make test-all`'s slow pass)."""
    from moelab.eval import doctest_tasks as D
    from moelab.eval.tasks import load_tasks

    tasks = load_tasks(["doctests"])["doctests"]
    man = json.loads((D.DATA / "doctests.json").read_text())
    assert len(tasks) == man["tasks"] >= 32 and all(t.kind == "tests" and t.check == D.RUNNER for t in tasks)
    rows = [json.loads(x) for x in (D.DATA / "doctests.jsonl").read_text().splitlines()]
    box = G.Sandbox(timeout=20)
    for t, r in list(zip(tasks, rows, strict=True))[::16]:
        assert G.check(t, r["solution"], box), t.name
        assert not G.check(t, "    pass\n", box), t.name


@pytest.mark.slow
def test_every_shipped_doctest_task_passes_its_body_and_fails_an_empty_one():
    from moelab.eval import doctest_tasks as D

    tasks = G.load_gen_tasks(D.DATA / "doctests.jsonl")
    rows = [json.loads(x) for x in (D.DATA / "doctests.jsonl").read_text().splitlines()]
    box = G.Sandbox(timeout=20)
    bad = [t.name for t, r in zip(tasks, rows, strict=True) if not G.check(t, r["solution"], box)]
    weak = [t.name for t in tasks if G.check(t, "    pass\n", box)]
    assert bad == [] and weak == []
