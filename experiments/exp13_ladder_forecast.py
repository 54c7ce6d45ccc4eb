"""The ladder as forecaster and fault detector, end to end on a laptop (what `make demo` runs).

Four tiny rungs of one recipe (ladders/demo.yaml: head size 8, two layers, learning rate by Marin's
rule, 20 tokens per active parameter) train on the standard library; one law of the loss in model
size and learning-rate schedule (the default law of moelab.ladder.forecast) is fitted to every
evaluation of every rung; the whole curve of a target with 12.8x the largest rung's compute is
forecast with a band and registered (hash and time) in the journal before the target trains; the
target trains monitored against it and the rungs' gradient-norm and drop trajectories, the forecast
refitted with the target's own evaluations as it goes (updates, recorded apart); its health summary
and forecast error are judged against the registered forecast.

Run it: moelab run experiments/exp13_ladder_forecast.py

Superseded by experiments/exp24_forecast_noise_floor.py (issue 24), which `make demo` runs: under the
forecast of issue 24 this one-seed ladder is refused (the band needs the spread between runs known with
three degrees of freedom), and its learning rate was the cause of its optimism.
"""

from pathlib import Path

from moelab.lab import Experiment, Prediction, output_of
from moelab.lab.steps import forecast_step, health_step, ladder_steps, train_step

LADDER = str(Path(__file__).resolve().parents[1] / "ladders" / "demo13.yaml")  # as declared

rungs, target_cfg = ladder_steps(LADDER)
forecast = forecast_step("demo-forecast", [output_of(r) for r in rungs], target_cfg)
target = train_step("demo-target", target_cfg, forecast=output_of(forecast) / "forecast.json")
health = health_step("demo-health", output_of(target))

experiment = Experiment(
    issue=13,
    slug="ladder_forecast",
    title="Four tiny rungs forecast the whole held-out loss curve of a model with 12.8x their largest compute",
    goal=(
        "Show the ladder practice on a laptop: rungs of one recipe, one law fitted to all their evaluations, "
        "a forecast with a band registered before the target trains, the target monitored against it, judged "
        "at the end."
    ),
    hypothesis=(
        "Rungs at widths 24 to 48 with one recipe follow one law of model size and learning-rate schedule "
        "closely enough that the forecast of the width-104 target's final held-out loss (dropless, macro over "
        "the three standard-library domains) is within 3% of what it reaches, and the target raises no "
        "health ALERT."
    ),
    prediction=Prediction(
        metric="demo-health:forecast.final_error_pct",
        value=0.0,
        low=-3.0,
        high=3.0,
        falsify_low=-6.0,
        falsify_high=6.0,
        rule="falsified if the forecast of the final held-out loss misses by more than 6%",
    ),
    steps=[health],
)
