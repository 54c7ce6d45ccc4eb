"""A training process's run state: everything the loop's core and its callbacks read and change,
made whole before the first step (``train.loop.prepare``), and what it computes on demand: a step's
batch and update, a phase's compiled step and evaluator, the held-out evaluation, a checkpoint.

Fault injection (``train.inject``, ``train.poison_steps``: a testing aid) wraps the batch and the
update from outside (``Injection``); the compiled production step takes no fault arguments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import optax

from moelab import accounting
from moelab.cache import remember, remembered
from moelab.config import Config, config_hash, data_seed, phase_config, rope_scaling_of, to_dict
from moelab.data.mixture import Mixture, batch_at, batch_rows, batch_targets, epochs_at
from moelab.data.store import TokenStore
from moelab.data.tokenizer import load_saved
from moelab.eval.generation import GenTask, score_model
from moelab.eval.tasks import model_loglik, score
from moelab.monitor.faults import Injector
from moelab.parallel import mesh as pmesh
from moelab.progress import say
from moelab.runs import RunDir
from moelab.train import checkpoint, optim
from moelab.train.evaluate import Evaluator
from moelab.train.step import make_train_step


class Injection:
    """The faults a run injects, around its batch and update: each fault's start is an event, the
    loader may serve another step's batch or rewrite rows, the state may be edited before the
    update, and the step compiled with fault arguments gets them (``make_train_step(faults=True)``)."""

    def __init__(self, injector: Injector, poison, run: RunDir):
        self.inj, self.poison, self.run = injector, set(poison), run

    def batch(self, rs: RunState, s: int):
        inj = self.inj
        for f in inj.starting(s):
            self.run.event("inject", step=s, fault=f.kind, arg=f.arg)
        d = inj.data_step(s)
        if not any(f.kind in ("data_corruption", "token_noise") for f in inj.active(s)):
            return rs.batch_of(d)
        # rows rewritten: every process builds the whole batch, then takes its rows
        batch, rows_domain = batch_at(rs.store, rs.mixture, data_seed(rs.cfg), d, rs.b, rs.s_len)
        vocab = rs.store.manifest["vocab_size"]
        batch = inj.corrupt(s, batch, rows_domain, rs.store.domains, vocab, rs.cfg.train.seed)
        return batch if rs.mesh is None else pmesh.put_batch(batch, rs.mesh)

    def update(self, fn, state: dict, s: int, batch):
        state = self.inj.edit_state(s, state)
        return fn(state, batch, np.int32(s), {**self.inj.step_args(s), "poison": np.bool_(s in self.poison)})


@dataclass
class RunState:
    """One training process's run (see the module's docstring)."""

    cfg: Config
    run: RunDir
    mesh: object | None  # the (data, expert) mesh, None on one device
    progress: bool
    store: TokenStore
    mixture: Mixture
    h: optim.Hyper
    opt: optax.GradientTransformation
    state: dict  # params, opt_state, model_state
    ckpts: checkpoint.Checkpoints
    start: int  # the first step this process runs
    skip: set  # batches the NaN guard ruled out (saved with every checkpoint)
    guard: dict  # the NaN guard's memory: non-finite steps in a row, restored since the last checkpoint
    cursor_ok: bool  # restored from a checkpoint: metrics.jsonl cut back to its cursor
    fresh: bool  # the state is the config's initial one
    task_sets: dict  # train.task_evals' examples
    injection: Injection | None
    lens: list  # each phase's sequence length (data.phase_seq_lens)
    shardings: object | None = None
    evals: set = field(default_factory=set)  # the steps evaluated at
    forecast: dict | None = None  # the forecast the run is held to
    lr_plan: np.ndarray | None = None  # the rate each step should apply, as registered
    peak: float | None = None  # one device's peak FLOP/s in the compute dtype, for MFU
    peak_source: str = ""
    by_len: dict = field(default_factory=dict)  # per sequence length: phase config, step, evaluator, FLOPs
    task_tok: object = None  # the run's tokenizer, for task evaluations

    @property
    def steps(self) -> int:
        return self.cfg.train.steps

    @property
    def b(self) -> int:
        return self.cfg.train.batch_size

    @property
    def s_len(self) -> int:
        return self.cfg.model.seq_len

    @property
    def n_devices(self) -> int:
        return self.cfg.mesh.data * self.cfg.mesh.expert

    # ------------------------------------------------------------------ a step

    def batch_of(self, d: int):
        """The loader's batch of data step ``d``: on a mesh each process builds only its devices' rows."""
        args = (self.store, self.mixture, data_seed(self.cfg), d, self.b, self.s_len)
        if self.mesh is not None:
            rows, length, _ = self.mixture.shape_at(d, self.b, self.s_len)
            return pmesh.put_rows(lambda lo, hi: batch_rows(*args, lo, hi)[0], (rows, length + 1), self.mesh)
        return batch_at(*args)[0]

    def batch(self, s: int):
        """Step ``s``'s batch (through the fault injection when the run injects faults)."""
        return self.batch_of(s) if self.injection is None else self.injection.batch(self, s)

    def update(self, fn, s: int, batch):
        """(new state, metrics) of step ``s`` by the compiled step ``fn``."""
        if self.injection is None:
            return fn(self.state, batch, np.int32(s))
        return self.injection.update(fn, self.state, s, batch)

    def at_length(self, step: int) -> dict:
        """What step ``step`` runs with, for its phase's sequence length (data.phase_seq_lens): the
        phase's config, its train step (compiled on first use), evaluator and FLOPs per token."""
        phase = self.mixture.phase_at(step)
        length = self.lens[phase]
        got = self.by_len.get(length)
        if got is None:
            pcfg = phase_config(self.cfg, phase)
            if len(set(self.lens)) > 1:
                scaling = rope_scaling_of(pcfg.model)
                self.run.event("context", step=step, phase=phase, seq_len=length, sequences=pcfg.train.batch_size,
                               rope={"scaling": scaling[0], "factor": scaling[1], "original_len": scaling[2]})  # fmt: skip
                if step > self.start:
                    rope = "RoPE unscaled" if scaling[0] == "none" else f"RoPE {scaling[0]} x{scaling[1]:g}"
                    say(f"step {step}: phase {phase} trains at {length} tokens a sequence, {pcfg.train.batch_size} "
                        f"sequences a batch ({rope}); compiling its step", self.progress)  # fmt: skip
            targets = batch_targets(pcfg, self.store)  # (masked, eot) of the batches
            got = self.by_len[length] = {
                "cfg": pcfg,
                "step": make_train_step(
                    pcfg,
                    self.opt,
                    self.h,
                    self.shardings,
                    mesh=self.mesh,
                    faults=self.injection is not None,
                    masked=targets[0],
                    eot=targets[1],
                ),  # fmt: skip
                "evaluator": None,
                "flops_per_token": 3 * accounting.count(pcfg).forward_flops_per_token,
            }
        return got

    def epochs_at(self, done: int) -> dict:
        """Passes over each domain's training windows after ``done`` steps."""
        return epochs_at(self.store, self.mixture, data_seed(self.cfg), done, self.b, self.s_len)

    # ------------------------------------------------------------------ evaluations and checkpoints

    def evaluator_at(self, done: int):
        """The evaluator of the phase that trained step ``done`` - 1 (the first phase's at step 0): the
        held-out windows at that phase's length, RoPE as it trains."""
        got = self.at_length(max(done - 1, 0))
        if got["evaluator"] is None:  # runs under the mesh, as the model trains
            got["evaluator"] = Evaluator(got["cfg"], self.store, mesh=self.mesh)
        return got

    def held_out(self, done: int) -> dict:
        """The ``eval`` metrics line after step ``done``: the held-out losses (and train.task_evals)."""
        t0 = time.perf_counter()
        now = self.at_length(max(done - 1, 0))
        # the initial model is the config's (its seed) and so are the windows: its held-out losses are
        # remembered in the cache (with the code, versions and machine that computed them), and the
        # same config's next run records them again without computing them (task scores are computed)
        key = None
        if done == 0 and self.fresh and not self.cfg.train.task_evals:
            key = {"config": to_dict(self.cfg), "store": self.store.manifest["key"]}
        res = remembered("initial_eval", key) if key is not None else None
        if res is None:
            res = self.evaluator_at(done)["evaluator"](self.state["params"], self.state["model_state"])
            if key is not None:
                remember("initial_eval", key, res)
        rec = {"kind": "eval", "step": done, "tokens": done * self.b * self.s_len, **res}
        if len(set(self.lens)) > 1:
            rec["seq_len"] = now["cfg"].model.seq_len  # the held-out windows' length, as the phase trains
        if self.cfg.train.task_evals:  # the tasks by log-likelihood, the model as this phase trains it
            rec["tasks"] = self.tasks(now["cfg"].model)
        rec["eval_seconds"] = time.perf_counter() - t0
        return rec

    def tasks(self, m) -> dict:
        """train.task_evals scored now: each task's acc, acc_norm, acc_bytes, chance and bits per byte, or
        a generation task's pass@1 (and pass@k with train.task_eval_samples k)."""
        if self.task_tok is None:
            self.task_tok = load_saved(self.store.path)
        params, ms = self.state["params"], self.state["model_state"]
        loglik = model_loglik(params, ms, m, self.task_tok, batch=32)
        keep = ("acc", "acc_norm", "acc_bytes", "chance", "bpb")
        k = self.cfg.train.task_eval_samples
        out = {}
        for name, ex in self.task_sets.items():
            if ex and isinstance(ex[0], GenTask):  # completions the model writes, checked: pass@1 (and pass@k)
                got = score_model(params, ms, m, self.task_tok, ex, samples=k)
                out[name] = {key: v for key, v in got.items() if key.startswith("pass@")}
            else:
                out[name] = {key: v for key, v in score(ex, loglik).items() if key in keep}
        return out

    def save(self, done: int) -> None:
        """A checkpoint after step ``done`` (in the background with train.async_checkpoint)."""
        meta = {
            "step": done,
            "metrics_cursor": self.run.metrics_cursor(),
            "skip_steps": sorted(self.skip),
            "nan_guard": dict(self.guard),
            "config_hash": config_hash(self.cfg),
            "config": to_dict(self.cfg),  # a resume names the fields an edited config.json changed
            "seed": self.cfg.train.seed,
            "time": time.time(),
        }
        self.ckpts.save(done, self.state, meta)
