"""Fault injection, to test the health checks: `moelab train --inject KIND@STEP[:ARG]`.

- lr_spike@S[:F]        the learning rate times F (10) from step S on
- data_corruption@S[:D] rows of domain D (every domain when D is left out) become random tokens
- router_collapse@S[:E] balancing switched off and expert E's (0) router bias pushed up by 10
- zloss_off@S[:F]       the logit z-loss switched off and the learning rate times F (3)
Each fault is recorded as an event when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = {"lr_spike": 10.0, "data_corruption": "", "router_collapse": 0, "zloss_off": 3.0}


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    arg: object


def parse(spec: str) -> Fault:
    """'lr_spike@100:5' -> Fault. Raises ValueError with a message naming the problem."""
    head, _, arg = spec.partition(":")
    kind, at, step = head.partition("@")
    if kind not in KINDS or not at:
        raise ValueError(f"{spec!r}: expected KIND@STEP[:ARG] with KIND one of {', '.join(KINDS)}")
    try:
        step_n = int(step)
    except ValueError:
        raise ValueError(f"{spec!r}: the step {step!r} is not a whole number") from None
    default = KINDS[kind]
    if not arg:
        value = default
    elif isinstance(default, str):
        value = arg
    else:
        try:
            value = type(default)(arg)
        except ValueError:
            raise ValueError(f"{spec!r}: {arg!r} is not a number") from None
    return Fault(kind, step_n, value)


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

    def step_args(self, step: int) -> dict:
        """The traced fault arguments of the train step at ``step``."""
        lr, z, freeze = 1.0, 1.0, False
        for f in self.active(step):
            if f.kind == "lr_spike":
                lr *= float(f.arg)
            elif f.kind == "zloss_off":
                lr *= float(f.arg)
                z = 0.0
            elif f.kind == "router_collapse":
                freeze = True
        return {"lr_scale": np.float32(lr), "logit_z_scale": np.float32(z), "freeze_bias": np.bool_(freeze)}

    def corrupt(
        self, step: int, batch: np.ndarray, rows_domain: np.ndarray, domains: list[str], vocab: int, seed: int
    ) -> np.ndarray:
        for f in self.active(step):
            if f.kind != "data_corruption":
                continue
            rows = np.ones(len(batch), bool) if not f.arg else rows_domain == domains.index(f.arg)
            rng = np.random.default_rng([seed, step, 7919])
            batch = batch.copy()
            batch[rows] = rng.integers(0, vocab, size=(int(rows.sum()), batch.shape[1]))
        return batch

    def edit_state(self, step: int, state: dict) -> dict:
        """At a router collapse's first step, push one expert's bias up in every layer."""
        for f in self.starting(step):
            if f.kind == "router_collapse":
                bias = state["model_state"]["router_bias"]
                state = dict(
                    state, model_state={**state["model_state"], "router_bias": bias.at[:, int(f.arg)].add(10.0)}
                )
        return state
