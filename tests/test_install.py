"""The package installs beside others: pyproject.toml states ranges, requirements.lock pins.

Fast: the ranges have tested lower bounds (requirements-min.txt) and no exact pins, the lock's pins
lie inside them, and the lock covers everything `pip install -c requirements.lock -e ".[dev]"`
installs. Slow: moelab installs into a fresh environment that already holds PyTorch,
transformers and a site's JAX without changing any of them (what issue 29 asked for).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

# what the slow test installs first, as a user's environment would hold it: PyTorch (the CPU wheel),
# transformers, and versions of what moelab shares with them that are in moelab's ranges but not the
# newest (exact pins of the newest would pass by luck): numpy, PyYAML, tqdm, tokenizers; a site's JAX
BESIDE = [
    "torch==2.13.0",
    "transformers==5.23.0",
    "numpy==2.3.5",
    "PyYAML==6.0.2",
    "tqdm==4.67.1",
    "tokenizers==0.23.1",
    "jax==0.9.2",
    "jaxlib==0.9.2",
]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins(path: Path) -> dict[str, Version]:
    """``name==version`` lines of a requirements file (comments and blanks skipped), by normalised name."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        r = Requirement(line)
        specs = list(r.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{path.name}:{n}: {line!r} is not an exact pin"
        out[canonicalize_name(r.name)] = Version(specs[0].version)
    return out


def lower_bound(spec: SpecifierSet) -> Version | None:
    lows = [Version(s.version) for s in spec if s.operator in (">=", "~=")]
    return max(lows) if lows else None


def check_range(req: str, where: str, upper: bool = True) -> list[str]:
    """What is wrong with one requirement's range: no lower bound, an exact pin, no upper bound."""
    r = Requirement(req)
    ops = {s.operator for s in r.specifier}
    bad = []
    if ops & {"==", "==="}:
        bad.append(f"{where}: {req!r} is an exact pin; state a range (the lock pins)")
    if lower_bound(r.specifier) is None:
        bad.append(f"{where}: {req!r} has no lower bound (>=)")
    if upper and not ops & {"<", "<=", "~="}:
        bad.append(f"{where}: {req!r} has no upper bound (<)")
    return bad


def test_runtime_dependencies_are_ranges_with_lower_and_upper_bounds():
    bad = [b for req in pyproject()["dependencies"] for b in check_range(req, "dependencies")]
    assert not bad, "\n".join(bad)


def test_extras_are_ranges_too():
    """Every extra but dev (the lock pins it) states ranges; fsspec is dated, so no upper bound to guess."""
    extras = pyproject()["optional-dependencies"]
    assert {"gpu", "tpu", "docs", "tracking", "ray", "remote", "bench", "harness", "dev"} <= set(extras)
    bad = [
        b
        for name, reqs in extras.items()
        if name != "dev"
        for req in reqs
        for b in check_range(req, f"optional-dependencies.{name}", upper=Requirement(req).name != "fsspec")
    ]
    assert not bad, "\n".join(bad)


def test_gpu_and_tpu_extras_are_jax_with_its_accelerator_in_the_same_range():
    deps = {canonicalize_name(Requirement(r).name): Requirement(r) for r in pyproject()["dependencies"]}
    extras = pyproject()["optional-dependencies"]
    for name, accel in (("gpu", "cuda12"), ("tpu", "tpu")):
        [r] = [Requirement(x) for x in extras[name]]
        assert r.name == "jax" and r.extras == {accel}, f"{name}: {r}"
        assert r.specifier == deps["jax"].specifier, f"{name}: {r.specifier} differs from jax's {deps['jax'].specifier}"
    # the docs the manual builds with are in dev, so CI's strict build has them
    dev = {canonicalize_name(Requirement(r).name) for r in extras["dev"]}
    assert {canonicalize_name(Requirement(r).name) for r in extras["docs"]} <= dev


def test_every_lock_pin_lies_in_the_ranges():
    lock = pins(ROOT / "requirements.lock")
    project = pyproject()
    reqs = [("dependencies", r) for r in project["dependencies"]]
    reqs += [(f"optional-dependencies.{k}", r) for k, v in project["optional-dependencies"].items() for r in v]
    bad = []
    for where, req in reqs:
        r = Requirement(req)
        name = canonicalize_name(r.name)
        if name not in lock:
            bad.append(f"requirements.lock: {r.name} ({where}) is not pinned")
        elif not r.specifier.contains(lock[name], prereleases=True):
            bad.append(f"requirements.lock: {r.name}=={lock[name]} lies outside {r.specifier} ({where})")
    assert not bad, "\n".join(bad)


def test_requirements_min_holds_the_lower_bounds():
    """requirements-min.txt is what the lower bounds were tested with (docs/install.md): one pin per
    runtime dependency, each its range's lower bound."""
    mins = pins(ROOT / "requirements-min.txt")
    lows = {
        canonicalize_name(Requirement(r).name): lower_bound(Requirement(r).specifier)
        for r in pyproject()["dependencies"]
    }
    assert set(mins) == set(lows), f"requirements-min.txt names {sorted(mins)}, the dependencies {sorted(lows)}"
    bad = [
        f"{n}: requirements-min.txt has {mins[n]}, the range's lower bound is {lows[n]}"
        for n in lows
        if mins[n] != lows[n]
    ]
    assert not bad, "\n".join(bad)


def closure(reqs: list[Requirement]) -> dict[str, str]:
    """The installed distributions that ``reqs`` bring, with the extras asked of them, by name -> version."""
    seen: dict[str, str] = {}
    done: set[tuple[str, str]] = set()  # (distribution, extra or "") whose requirements are queued
    todo = [(r, "") for r in reqs]
    while todo:
        r, extra = todo.pop()
        if r.marker is not None and not r.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(r.name)
        try:
            dist = md.distribution(r.name)
        except md.PackageNotFoundError:
            pytest.fail(f"{r.name} is not installed: pip install -c requirements.lock -e '.[dev]'")
        seen[name] = dist.version
        for e in {""} | set(r.extras):
            if (name, e) not in done:
                done.add((name, e))
                for sub in (Requirement(x) for x in dist.requires or []):
                    # its own requirements under "", an extra's under that extra
                    if (sub.marker is not None and "extra" in str(sub.marker)) == bool(e):
                        todo.append((sub, e))
    return seen


def test_lock_covers_what_the_dev_install_brings():
    """Every distribution `pip install -c requirements.lock -e ".[dev]"` installs is pinned, at the version
    installed here: a dependency the lock lacks would float to whatever is newest in CI."""
    project = pyproject()
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    lock = pins(ROOT / "requirements.lock")
    installed = closure(reqs)
    missing = sorted(n for n in installed if n not in lock)
    assert not missing, f"requirements.lock lacks {missing}: add their versions from pip freeze"
    drift = [f"{n}: installed {v}, locked {lock[n]}" for n, v in installed.items() if Version(v) != lock[n]]
    assert not drift, "\n".join(drift)


def venv_python(env: Path) -> Path:
    return env / ("Scripts" if os.name == "nt" else "bin") / "python"


def freeze(python: Path) -> dict[str, str]:
    out = subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        if "==" in line:
            name, version = line.split("==", 1)
            got[canonicalize_name(name)] = version
        elif " @ " in line:
            name, url = line.split(" @ ", 1)
            got[canonicalize_name(name)] = url
    return got


def pip(python: Path, *args: str) -> None:
    proc = subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"pip {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


@pytest.mark.slow
def test_installs_beside_torch_transformers_and_a_sites_jax_without_changing_them(tmp_path):
    """A fresh environment (no system site-packages) with PyTorch, transformers and JAX; then moelab as a
    user installs it (no -c requirements.lock): nothing that was there changes, pip check passes and
    the command runs."""
    start = time.monotonic()
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", env], check=True)
    py = venv_python(env)
    assert subprocess.run([py, "-c", "import sys; assert sys.prefix != sys.base_prefix"]).returncode == 0
    pip(py, "install", "-q", *BESIDE)
    before = freeze(py)
    assert "moelab" not in before and {"torch", "transformers", "jax", "numpy"} <= set(before)

    # the working tree's package, copied so the build leaves nothing in the checkout
    src = tmp_path / "moelab"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip(py, "install", "-q", str(src))

    after = freeze(py)
    changed = [f"{n}: {v} -> {after.get(n, 'removed')}" for n, v in before.items() if after.get(n) != v]
    assert not changed, "installing moelab changed what was there:\n" + "\n".join(changed)
    assert "moelab" in after
    pip(py, "check")
    moelab = env / "bin" / "moelab"
    proc = subprocess.run([moelab, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "train" in proc.stdout, proc.stderr[-2000:]
    # the library's imports against these versions: the model, training, checkpoints, the export
    code = (
        "import jax, torch, transformers, moelab.train.loop, moelab.train.checkpoint, moelab.export;"
        "import moelab.model.transformer as t; print(jax.__version__)"
    )
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "0.9.2", proc.stderr[-2000:]
    print(f"install check: {time.monotonic() - start:.0f} s")


def test_every_extra_a_message_names_exists():
    """`pip install 'moelab[X]'` in an error message or a page must name an extra pyproject.toml has."""
    import re

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    named = {
        (f.name, x)
        for f in files
        for group in re.findall(r"moelab\[([^\]\s]+)\]", f.read_text())
        for x in group.split(",")
    }
    assert named, "the messages name extras"
    assert not [(f, x) for f, x in named if x not in extras], sorted((f, x) for f, x in named if x not in extras)


def _third_party_imports(src: Path) -> dict[str, set[str]]:
    """Top-level name -> the files of src/moelab that import it (at the top or inside a function),
    outside the standard library and moelab itself; the exported model's remote code is left out
    (it runs inside transformers, not moelab)."""
    import ast

    found: dict[str, set[str]] = {}
    for path in (src / "moelab").rglob("*.py"):
        if "remote_code" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("moelab", "__future__"):
                    found.setdefault(top, set()).add(str(path.relative_to(src)))
    return found


def test_every_package_moelab_imports_is_declared():
    """Each third-party module moelab imports comes from a distribution pyproject.toml names, in its
    dependencies or an extra (etils and psutil arrived only through Orbax before issue 40)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for v in project["optional-dependencies"].values() for r in v]
    declared = {canonicalize_name(Requirement(r).name) for r in reqs}
    providers = md.packages_distributions()
    found = _third_party_imports(ROOT / "src")
    assert {"jax", "orbax", "etils", "psutil"} <= set(found)  # the scan sees what moelab imports
    missing = {
        name: sorted(where)
        for name, where in found.items()
        if not {canonicalize_name(d) for d in providers.get(name, [name])} & declared
    }
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
