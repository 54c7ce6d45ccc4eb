"""Mirrors of the metrics to Weights & Biases (offline, no account) or TensorBoard, when installed.

The local files are always written; a tracker only copies what goes into metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path

from moelab.config import Config, to_dict
from moelab.errors import UsageError


def _flat(rec: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in rec.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}/"))
        elif isinstance(v, bool):
            continue
        elif isinstance(v, (int, float)) or (hasattr(v, "item") and getattr(v, "ndim", 1) == 0):
            out[key] = float(v)
    return out


class WandbTracker:
    def __init__(self, cfg: Config, out: Path):
        import os

        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project="moelab", name=Path(out).name, dir=str(out), mode="offline", config=to_dict(cfg))

    def log(self, rec: dict) -> None:
        self.run.log({f"{rec['kind']}/{k}": v for k, v in _flat(rec).items()}, step=rec["step"])

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, cfg: Config, out: Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(Path(out) / "tensorboard"))

    def log(self, rec: dict) -> None:
        for k, v in _flat(rec).items():
            self.writer.add_scalar(f"{rec['kind']}/{k}", v, rec["step"])

    def close(self) -> None:
        self.writer.close()


def make_trackers(names: list[str], cfg: Config, out: str | Path) -> list:

    kinds = {"wandb": (WandbTracker, "wandb"), "tensorboard": (TensorBoardTracker, "tensorboardX")}
    trackers = []
    for name in names:
        cls, package = kinds[name]
        try:
            __import__(package)
        except ImportError:
            raise UsageError(
                f"--tracker {name}: the {package} package is not installed; pip install 'moelab[{name}]'"
            ) from None
        Path(out).mkdir(parents=True, exist_ok=True)
        trackers.append(cls(cfg, Path(out)))
    return trackers
