"""Ready-made steps: train a config, evaluate a checkpoint. Experiments compose them."""

from __future__ import annotations

from pathlib import Path

from moelab.lab.graph import Step, versioned


def _config(cfg: dict):
    from moelab.config import load_config

    return load_config(cfg["config"], list(cfg.get("overrides", [])))


def _train(cfg: dict, out: Path) -> dict:
    from moelab.train.loop import train

    # resume=True: a rerun of a failed step continues from its newest checkpoint
    return train(_config(cfg), out, resume=True, progress=cfg.get("progress", True))


def _estimate(cfg: dict) -> dict:
    from moelab import accounting

    c = _config(cfg)
    tokens = accounting.run_tokens(c)
    return {"flops": accounting.count(c).train(tokens)["train_flops"], "tokens": tokens}


def train_step(name: str, config: str, overrides: list[str] = (), *, progress: bool = True, **resources) -> Step:
    """Train ``config`` (a preset or YAML path) with ``overrides``; both are versioned."""
    return Step(
        name=name,
        fn=_train,
        config={"config": versioned(config), "overrides": versioned(list(overrides)), "progress": progress},
        resources=resources,
        estimate=_estimate,
    )


def _evaluate(cfg: dict, out: Path) -> dict:
    import json

    from moelab.train.evaluate import evaluate_run

    result = evaluate_run(cfg["run"], cfg.get("checkpoint"), progress=False)
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result


def eval_step(name: str, run, checkpoint: int | None = None) -> Step:
    """Evaluate a training step's newest (or a given) checkpoint: ``run`` is ``output_of(train)``."""
    return Step(name=name, fn=_evaluate, config={"run": versioned(run), "checkpoint": versioned(checkpoint)})
