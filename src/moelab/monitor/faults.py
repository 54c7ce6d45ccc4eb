"""Fault injection, to test the health checks: `moelab train --inject KIND@STEP[:ARG]`.

Each fault changes one thing, from step S on:
- lr_spike@S[:F]        the learning rate the optimiser applies, times F (10): the plan stays as it was
- lr_high@S[:F]         the planned learning rate itself times F (3), as a wrong config would: only
                        what the model does can show it
- data_corruption@S[:D] rows of domain D (every domain when D is left out) become random tokens
- token_noise@S[:P]     a fraction P (0.1) of every batch's tokens become random tokens: a fault whose
                        size is set by P (the held-out loss rises by a few percent, not a blow-up)
- data_stuck@S[:N]      the loader repeats the N (4) batches from step S over and over
- router_collapse@S[:E] balancing switched off and expert E's (0) router bias pushed up by 10
- router_drift@S[:R]    expert 0's router weights grow by a factor (1 + R) (R = 0.02) every step
- zloss_off@S           the logit z-loss switched off (nothing else)
Each fault is recorded as an event when it starts. The specs are parsed by moelab.config.faults.
"""

from __future__ import annotations

import numpy as np

from moelab.config.faults import KINDS, Fault, parse

# the specs are parsed in moelab.config.faults (a config is checked before any compute); their names stay
# importable from here
__all__ = ["KINDS", "Fault", "Injector", "parse"]


class Injector:
    def __init__(self, specs, domains: list[str]):
        self.faults = [parse(s) for s in specs]
        for f in self.faults:
            if f.kind == "data_corruption" and f.arg and f.arg not in domains:
                raise ValueError(f"train.inject: data_corruption names {f.arg!r}, not a domain ({', '.join(domains)})")

    def active(self, step: int) -> list[Fault]:
        return [f for f in self.faults if step >= f.step]

    def starting(self, step: int) -> list[Fault]:
        return [f for f in self.faults if step == f.step]

    def plan_scale(self, step: int) -> float:
        """How much the planned learning rate itself is off at ``step`` (lr_high)."""
        scale = 1.0
        for f in self.active(step):
            if f.kind == "lr_high":
                scale *= float(f.arg)
        return scale

    def step_args(self, step: int) -> dict:
        """The traced fault arguments of the train step at ``step``."""
        lr, z, freeze = self.plan_scale(step), 1.0, False
        for f in self.active(step):
            if f.kind == "lr_spike":
                lr *= float(f.arg)
            elif f.kind == "zloss_off":
                z = 0.0
            elif f.kind == "router_collapse":
                freeze = True
        return {"lr_scale": np.float32(lr), "logit_z_scale": np.float32(z), "freeze_bias": np.bool_(freeze)}

    def data_step(self, step: int) -> int:
        """The batch the loader serves at ``step`` (data_stuck repeats a few)."""
        for f in self.active(step):
            if f.kind == "data_stuck":
                return f.step + (step - f.step) % int(f.arg)
        return step

    def corrupt(
        self, step: int, batch: np.ndarray, rows_domain: np.ndarray, domains: list[str], vocab: int, seed: int
    ) -> np.ndarray:
        for f in self.active(step):
            if f.kind == "token_noise":
                rng = np.random.default_rng([seed, step, 7993])
                hit = rng.random(batch.shape) < float(f.arg)
                batch = np.where(hit, rng.integers(0, vocab, size=batch.shape), batch).astype(batch.dtype)
                continue
            if f.kind != "data_corruption":
                continue
            rows = np.ones(len(batch), bool) if not f.arg else rows_domain == domains.index(f.arg)
            rng = np.random.default_rng([seed, step, 7919])
            batch = batch.copy()
            batch[rows] = rng.integers(0, vocab, size=(int(rows.sum()), batch.shape[1]))
        return batch

    def edit_state(self, step: int, state: dict) -> dict:
        """A router collapse pushes one expert's bias up at its first step; a drift grows expert 0's
        router weights a little every step."""
        for f in self.active(step):
            if f.kind == "router_collapse" and step == f.step:
                bias = state["model_state"]["router_bias"]
                state = dict(
                    state, model_state={**state["model_state"], "router_bias": bias.at[:, int(f.arg)].add(10.0)}
                )
            elif f.kind == "router_drift":
                layers = state["params"]["layers"]
                router = layers["router"].at[..., 0].multiply(1.0 + float(f.arg))
                state = dict(state, params={**state["params"], "layers": {**layers, "router": router}})
        return state
