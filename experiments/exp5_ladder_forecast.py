"""The ladder as forecaster and fault detector, end to end on a laptop (what `make demo` runs).

Three tiny rungs of one recipe (ladders/demo5.yaml: head size 16, two layers, learning rate by
Marin's rule, 20 tokens per active parameter) train on the standard library; Marin's form
L(C) = E + A * C^-alpha is fitted across them at every 5% of training; the target's whole curve
is forecast and registered (hash and time) in the journal before the target trains; the target
trains monitored against the forecast band and the rungs' gradient-norm and drop trajectories;
its health summary and forecast error are judged.

Run it: moelab run experiments/exp5_ladder_forecast.py
"""

from pathlib import Path

from moelab.lab import Experiment, Prediction, output_of
from moelab.lab.steps import forecast_step, health_step, ladder_steps, train_step

LADDER = str(Path(__file__).resolve().parents[1] / "ladders" / "demo5.yaml")

rungs, target_cfg = ladder_steps(LADDER)
forecast = forecast_step("demo-forecast", [output_of(r) for r in rungs], target_cfg, law="per-fraction")
target = train_step("demo-target", target_cfg, forecast=output_of(forecast) / "forecast.json")
health = health_step("demo-health", output_of(target))

experiment = Experiment(
    issue=5,
    slug="ladder_forecast",
    title="A tiny ladder forecasts a wider model's whole held-out loss curve",
    goal=(
        "Show the ladder practice on a laptop: rungs of one recipe, fits at every 5%, a forecast "
        "registered before the target trains, the target monitored against it, judged at the end."
    ),
    hypothesis=(
        "Rungs at widths 32, 48 and 64 with one recipe follow L(C) = E + A * C^-alpha closely enough "
        "that the forecast of the width-96 target's final held-out loss (dropless, macro over the three "
        "standard-library domains) is within 3% of what it reaches, and the target raises no health ALERT."
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
