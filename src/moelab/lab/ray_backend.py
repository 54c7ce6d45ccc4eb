"""`--backend ray`: each step's function runs as a Ray task with the step's resource requests.

Leases, status files and the journal stay with the runner, so the record is the same whichever
backend ran the work. A local Ray instance starts by default; MOELAB_RAY_ADDRESS (or
`moelab run --ray-address`) joins a cluster. Ray is an optional extra: pip install 'moelab[ray]'.
"""

from __future__ import annotations

from pathlib import Path

from moelab.extras import ray_session as _ray


def _execute(fn, config: dict, out: str):
    return fn(config, Path(out))


def submit(pool, runner, step):
    ray = _ray()
    remote = ray.remote(_execute)
    options = dict(step.resources) or {"num_cpus": 1}

    def call(config: dict, out: Path):
        return ray.get(remote.options(**options).remote(step.fn, config, str(out)))

    return pool.submit(runner.run_step, step, call)
