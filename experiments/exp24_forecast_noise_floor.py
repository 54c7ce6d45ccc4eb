"""The ladder at the noise floor, end to end on a laptop (what `make demo` runs).

Four tiny rungs of one recipe (ladders/demo.yaml: head size 8, two layers, Marin's learning-rate rule
times 4, 20 tokens per active parameter), each trained with two seeds on the standard library; one law
of the loss in model size and learning-rate schedule (the default law of moelab.ladder.forecast) is
fitted to every evaluation of the eight rung runs; the whole curve of a target with 12.8x the largest
rung's compute is forecast with a 90% band (one offset per seed, autocorrelated noise, a model error
from leaving each size out) and registered in the journal before the target trains; the target trains
monitored against it, its forecast refitted with its own evaluations as it goes (updates, recorded
apart); its health summary and forecast error are judged against the registered forecast. The
forecast is of the held-out loss weighted by the training mixture (`mix`).

Run it: moelab run experiments/exp24_forecast_noise_floor.py
"""

import dataclasses
from pathlib import Path

from moelab.eval.builtin import BUILTIN
from moelab.lab import Experiment, Prediction, output_of
from moelab.lab.steps import forecast_step, health_step, ladder_steps, train_step

LADDER = str(Path(__file__).resolve().parents[1] / "ladders" / "demo.yaml")

rungs, target_cfg = ladder_steps(LADDER)
# the target also scores moelab's built-in tasks at every evaluation (issue 28): measured beside the
# loss, never hashed, so the forecast and the prediction above are as registered
target_cfg = dataclasses.replace(target_cfg, train=dataclasses.replace(target_cfg.train, task_evals=BUILTIN))
forecast = forecast_step("demo-forecast", [output_of(r) for r in rungs], target_cfg)
target = train_step("demo-target", target_cfg, forecast=output_of(forecast) / "forecast.json")
health = health_step("demo-health", output_of(target))

experiment = Experiment(
    issue=24,
    slug="forecast_noise_floor",
    title="Eight rung runs of a tuned recipe forecast a 12.8x target's whole held-out curve within 2%",
    goal=(
        "Show the ladder as forecaster on a laptop with the recipe of issue 24: rungs near their best learning "
        "rate, two seeds each, a band that knows its degrees of freedom and the law's own error, registered "
        "before the target trains."
    ),
    hypothesis=(
        "With every size trained at 4x Marin's rate (where the rule's shortfall no longer shrinks with size) "
        "the forecast of the width-104 target's final held-out loss (dropless, mixture-weighted) from four sizes "
        "with two seeds each is within 2% of what the target reaches, inside its 90% band, and the target raises "
        "no health ALERT."
    ),
    prediction=Prediction(
        metric="demo-health:forecast.final_error_pct",
        value=0.0,
        low=-2.0,
        high=2.0,
        falsify_low=-4.0,
        falsify_high=4.0,
        rule="falsified if the forecast of the final held-out loss misses by more than 4%",
    ),
    steps=[health],
)
