"""Mirrors of the metrics to Weights & Biases or TensorBoard, when installed.

The local files are always written; a tracker only copies what goes into metrics.jsonl, per-layer
series included (``dropped_frac_per_layer/layer_0``, ...). W&B runs offline unless the config
(``train.tracker_mode``) or the environment (``WANDB_MODE``) says otherwise; its project and entity
come from ``train.tracker_project`` / ``train.tracker_entity``, else ``WANDB_PROJECT`` /
``WANDB_ENTITY``, else project "moelab". A run keeps its W&B id in its folder (``wandb_id``), so a
resumed run continues the same W&B run. In the lab, the experiment and the step are its tags.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np

from moelab.config import Config, to_dict
from moelab.errors import UsageError


def _flat(rec: dict, prefix: str = "") -> dict:
    """Numbers by a path of keys; a list of numbers (one per layer) as one series per layer. A list of
    lists (each layer's expert loads) is left to metrics.jsonl: per layer, max_mean_load is its series."""
    out = {}
    for k, v in rec.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}/"))
        elif isinstance(v, bool):
            continue
        elif isinstance(v, (int, float)) or (hasattr(v, "item") and getattr(v, "ndim", 1) == 0):
            out[key] = float(v)
        elif isinstance(v, (list, tuple)) or hasattr(v, "__array__"):
            arr = np.asarray(v)
            if arr.ndim == 1 and arr.size and np.issubdtype(arr.dtype, np.number):
                out.update({f"{key}/layer_{i}": float(x) for i, x in enumerate(arr)})
    return out


def wandb_settings(cfg: Config, out: Path, env=None, tags=()) -> dict:
    """What ``wandb.init`` is called with: project, entity, mode, the run's name and id (kept in the
    run folder, so a resume continues the same W&B run), tags and config. No network is touched."""
    env = os.environ if env is None else env
    t = cfg.train
    out = Path(out)
    id_file = out / "wandb_id"
    if id_file.is_file():
        run_id, resumed = id_file.read_text().strip(), True
    else:
        run_id, resumed = uuid.uuid4().hex[:12], False
    return {
        "project": t.tracker_project or env.get("WANDB_PROJECT") or "moelab",
        "entity": t.tracker_entity or env.get("WANDB_ENTITY") or None,
        "mode": t.tracker_mode or env.get("WANDB_MODE") or "offline",
        "name": out.name,
        "id": run_id,
        "resume": "allow" if resumed else None,
        "tags": list(tags),
        "dir": str(out),
        "config": to_dict(cfg),
    }


class WandbTracker:
    def __init__(self, cfg: Config, out: Path, tags=()):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        settings = wandb_settings(cfg, out, tags=tags)
        id_file = Path(out) / "wandb_id"
        if not id_file.is_file():  # before the run starts: a crash right after still resumes this id
            tmp = id_file.with_name(".wandb_id.tmp")
            tmp.write_text(settings["id"])
            tmp.replace(id_file)
        self.settings = settings
        self.run = wandb.init(**settings)

    def log(self, rec: dict) -> None:
        self.run.log({f"{rec['kind']}/{k}": v for k, v in _flat(rec).items()}, step=rec["step"])

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, cfg: Config, out: Path, tags=()):
        from tensorboardX import SummaryWriter

        # a resumed run writes a new event file into the same folder: TensorBoard reads them as one run
        self.writer = SummaryWriter(str(Path(out) / "tensorboard"))
        if tags:
            self.writer.add_text("tags", ", ".join(tags), 0)

    def log(self, rec: dict) -> None:
        for k, v in _flat(rec).items():
            self.writer.add_scalar(f"{rec['kind']}/{k}", v, rec["step"])

    def close(self) -> None:
        self.writer.close()


def make_trackers(names, cfg: Config, out: str | Path, tags=()) -> list:
    """The trackers named here and in ``train.trackers`` (each once)."""
    kinds = {"wandb": (WandbTracker, "wandb"), "tensorboard": (TensorBoardTracker, "tensorboardX")}
    trackers = []
    for name in dict.fromkeys([*names, *cfg.train.trackers]):
        cls, package = kinds[name]
        try:
            __import__(package)
        except ImportError:
            raise UsageError(
                f"--tracker {name}: the {package} package is not installed; pip install 'moelab[tracking]' (or pip install {package})"
            ) from None
        Path(out).mkdir(parents=True, exist_ok=True)
        trackers.append(cls(cfg, Path(out), tags=tags))
    return trackers
