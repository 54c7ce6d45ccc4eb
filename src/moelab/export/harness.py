"""`moelab eval RUN --harness TASK,...`: lm-evaluation-harness on a run's checkpoint, offline.

The checkpoint is exported to a temporary folder (``export_hf``: padded batches and a KV cache, so
the harness's batched log-likelihoods and ``generate_until`` work), loaded by lm-eval's ``HFLM``
with ``trust_remote_code`` and scored on the named tasks. Nothing is downloaded at run time
(``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set for the call): a task is lm-eval's name of
one whose dataset is already in the local Hugging Face cache, or the path of a task YAML whose data
is local (``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``). Results are saved to
evals/step_N-harness.json. lm-eval is the optional extra ``moelab[harness]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from moelab.errors import UsageError
from moelab.export import checkpoint_step
from moelab.export.hf import export_hf
from moelab.progress import say
from moelab.runs import RunDir, load_run_config

NEEDS = "--harness: needs lm-evaluation-harness: pip install 'moelab[harness]'"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
_MANAGERS: dict = {}  # (TaskManager, include_defaults) -> a TaskManager


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # needs torch, transformers and accelerate too
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UsageError(NEEDS) from None
    return lm_eval, HFLM, TaskManager


@contextlib.contextmanager
def offline():
    """The Hugging Face hub and datasets offline for the block (the environment, and the flags
    huggingface_hub and datasets read at import, where they are already imported)."""
    import sys

    saved_env = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    flags = [(sys.modules.get("huggingface_hub.constants"), "HF_HUB_OFFLINE"),
             (sys.modules.get("datasets.config"), "HF_HUB_OFFLINE"),
             (sys.modules.get("datasets.config"), "HF_DATASETS_OFFLINE")]  # fmt: skip
    saved = [(mod, name, getattr(mod, name)) for mod, name in flags if mod is not None and hasattr(mod, name)]
    for mod, name, _ in saved:
        setattr(mod, name, True)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _is_path(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or os.sep in spec


def load_tasks(specs: Sequence[str], task_manager_cls) -> tuple[list, object]:
    """lm-eval's tasks for ``specs`` (names or YAML paths), their data read now, and the task manager;
    a spec that is not a task, or whose data is not on the machine, is refused in one line."""
    paths = [s for s in specs if _is_path(s)]
    for p in paths:
        if not Path(p).is_file():
            raise UsageError(f"--harness: {p}: no such task YAML")
    # lm-eval's own index (thousands of YAML files, seconds to scan) only when a name needs it, once a process
    defaults = len(paths) < len(specs)
    if (task_manager_cls, defaults) not in _MANAGERS:
        _MANAGERS[task_manager_cls, defaults] = task_manager_cls(include_defaults=defaults)
    manager = _MANAGERS[task_manager_cls, defaults]
    tasks = []
    with _quiet_datasets():
        for spec in specs:
            tasks.extend(_load_one(spec, manager))
    for task in tasks:
        check_documents(task)
    return tasks, manager


@contextlib.contextmanager
def _quiet_datasets():
    """No `datasets` progress bars while the tasks' data is read: a refusal stays one line."""
    try:
        from datasets.utils import logging as dlog
    except ImportError:
        yield
        return
    was = dlog.is_progress_bar_enabled()
    dlog.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            dlog.enable_progress_bar()


def _load_one(spec: str, manager) -> list:
    """One spec's tasks, its data read now; refused in one line when it cannot run here."""
    if not _is_path(spec) and spec not in manager.all_tasks:
        raise UsageError(f"--harness: {spec}: not an lm-eval task (list them: lm-eval ls tasks), nor a task YAML")
    try:
        loaded = manager.load([str(Path(spec).resolve()) if _is_path(spec) else spec])
    except (OSError, ConnectionError) as exc:  # datasets: offline and not cached, or a data file missing
        raise UsageError(
            f"--harness: {spec}: its dataset is not on this machine (not in the local Hugging Face cache, "
            f"or its data_files are missing), and nothing is downloaded at run time ({str(exc).splitlines()[0]})"
        ) from None
    except (KeyError, ValueError, TypeError) as exc:
        raise UsageError(f"--harness: {spec}: lm-eval refused the task ({str(exc).splitlines()[0]})") from None
    return list(loaded["tasks"].values())


def check_documents(task, limit: int | None = None) -> None:
    """Every document ``task`` will score reads through its YAML's fields (text, target and, for multiple
    choice, the choices); one that does not (a field missing, a choice list where there is none) is
    refused in one line naming the task and the document, before anything is exported."""
    docs = task.eval_docs
    n = len(docs) if limit is None else min(limit, len(docs))
    for i in range(n):
        doc = docs[i]
        try:
            task.doc_to_text(doc)
            target = task.doc_to_target(doc)
            if task.OUTPUT_TYPE == "multiple_choice":
                choices = task.doc_to_choice(doc)
                if not isinstance(choices, list) or not choices:
                    raise ValueError(f"its choices are {choices!r}, not a list")
                if isinstance(target, int) and not 0 <= target < len(choices):
                    raise ValueError(f"its target {target} is not one of its {len(choices)} choices")
        except Exception as exc:  # lm-eval's field readers raise whatever the document makes them
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UsageError(
                f"--harness: {task.task_name}: document {i} does not fit the task's fields ({msg}); "
                "check doc_to_text, doc_to_target and doc_to_choice against its data"
            ) from None


def _first(resp):
    """A response as a number where it is one: a log-likelihood request's (loglik, is_greedy) -> loglik."""
    return float(resp[0]) if isinstance(resp, (tuple, list)) and resp and isinstance(resp[0], float) else resp


def _metrics(results: dict) -> dict:
    """lm-eval's per-task results with the filter suffix dropped where it is the default (``acc,none`` -> ``acc``)."""
    out = {}
    for task, res in results.items():
        row = {}
        for key, value in res.items():
            if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            row[metric if filt in ("", "none") else key] = value
        out[task] = row
    return out


def evaluate_harness(
    run_dir,
    specs: Sequence[str],
    step: int | None = None,
    batch_size: int = 8,
    limit: int | None = None,
    progress: bool = True,
    samples: bool = False,
) -> dict:
    """lm-eval's scores of the run's newest (or a given) checkpoint on ``specs`` (task names or YAML
    paths), saved to evals/step_N-harness.json. ``samples``: also each document's raw responses
    (for a log-likelihood task, each request's log-likelihood), in the result only."""
    with offline():
        lm_eval, HFLM, TaskManager = _import_lm_eval()
        load_run_config(run_dir)  # a run with a checkpoint, refused in one line if not
        step = checkpoint_step(run_dir, step)
        tasks, manager = load_tasks(specs, TaskManager)  # every task's data read before the export
        import torch

        with tempfile.TemporaryDirectory(prefix="moelab-harness-") as tmp:
            folder = Path(tmp) / "model"
            say(f"exporting step {step} to transformers for lm-eval ...", progress)
            export_hf(run_dir, folder, step, progress)
            device = "cuda" if torch.cuda.is_available() else "cpu"
            lm = HFLM(pretrained=str(folder), trust_remote_code=True, batch_size=batch_size, device=device)
            say(f"running lm-eval {lm_eval.__version__} on {', '.join(t.task_name for t in tasks)}", progress)
            out = lm_eval.simple_evaluate(
                model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=samples, bootstrap_iters=1000
            )
    res = {
        "step": step,
        "lm_eval": lm_eval.__version__,
        "specs": list(specs),
        "tasks": _metrics(out["results"]),
        "examples": {t: n.get("effective") for t, n in out.get("n-samples", {}).items()},
    }
    run = RunDir(run_dir)
    (run.path / "evals").mkdir(exist_ok=True)
    (run.path / "evals" / f"step_{step:08d}-harness.json").write_text(json.dumps(res, indent=1))
    if samples:
        res["samples"] = {
            task: [
                {"doc_id": s["doc_id"], "target": s["target"], "resps": [_first(r) for r in s["filtered_resps"]]}
                for s in rows
            ]  # fmt: skip
            for task, rows in out["samples"].items()
        }
    return res
