"""Fault specs, as ``train.inject`` and `moelab train --inject` take them: KIND@STEP[:ARG].

The kinds and what each does are in moelab.monitor.faults, whose Injector applies them; here they are
only parsed, so that a config is checked before any compute. KINDS maps each kind to its default
argument (None: the kind takes none; a string: any text, such as a domain's name).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = {
    "lr_spike": 10.0,
    "lr_high": 3.0,
    "data_corruption": "",
    "token_noise": 0.1,
    "data_stuck": 4,
    "router_collapse": 0,
    "router_drift": 0.02,
    "zloss_off": None,
}


@dataclass(frozen=True)
class Fault:
    """One fault: its kind, the step it starts at and its argument (the kind's default where none is given)."""

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
    if step_n < 0:
        raise ValueError(f"{spec!r}: the step must be >= 0, got {step_n}")
    default = KINDS[kind]
    if default is None:
        if arg:
            raise ValueError(f"{spec!r}: {kind} takes no argument")
        return Fault(kind, step_n, None)
    if not arg:
        value = default
    elif isinstance(default, str):
        value = arg
    else:
        try:
            value = type(default)(arg)
        except ValueError:
            raise ValueError(f"{spec!r}: {arg!r} is not a number") from None
        if value <= 0:
            raise ValueError(f"{spec!r}: the argument must be > 0, got {arg}")
        if kind == "token_noise" and value > 1:
            raise ValueError(f"{spec!r}: token_noise takes a fraction of tokens in (0, 1], got {arg}")
    return Fault(kind, step_n, value)
