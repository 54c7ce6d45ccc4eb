"""The train section of a config: steps and batch, optimizer and learning-rate schedule, evaluation,
checkpoints, trackers and memory placement, each field with its meaning, and the checks of its own
fields (fault specs and horizon changes parsed as the run will parse them)."""

from __future__ import annotations

from dataclasses import dataclass

from moelab.config.faults import parse as parse_fault
from moelab.config.fields import CKPT_WRITERS, OFFLOADS, OPTIMIZERS, SCHEDULES, _f
from moelab.schedule import parse_replans


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(200, "Optimizer updates in the run (the horizon the learning-rate schedule is planned over).")
    batch_size: int = _f(
        16,
        "Sequences of model.seq_len tokens per step, over all devices. Must split evenly over mesh.data x mesh.expert.",
    )
    seed: int = _f(
        0,
        "Seed of the parameters' initialisation and of the data order, in [0, 2**32). Batches are a function of seed and step.",
    )
    data_seed: int = _f(
        -1,
        "Seed of the data order alone, in [0, 2**32); -1 = train.seed. Changes which batch each step reads and leaves the initialisation as train.seed makes it.",
    )
    optimizer: str = _f(
        "adamw",
        "Optimizer: adamw or muon. adamw: AdamW with decoupled weight decay; muon: Muon for the attention and expert matrices, AdamW for the rest (embeddings, head, router, norms).",
        OPTIMIZERS,
    )
    lr: float | str = _f(
        0.003,
        "Peak learning rate (AdamW's, reached at the end of warmup): a number, or auto. auto is Marin's compute-scaled heuristic, which also sets Adam's beta2 and epsilon from the run's tokens, batch and d_model.",
    )
    lr_scale: float = _f(
        1.0,
        "The peak rate (Adam's and Muon's) times this: a learning-rate sweep around a rule such as auto. A number > 0.",
    )
    warmup_frac: float = _f(0.01, "Fraction of the steps with a linear warmup to the peak rate, in [0, 1).")
    min_lr_ratio: float = _f(
        0.05,
        "Where the decay ends, as a fraction of the peak rate, in [0, 1]. The linear and wsd schedules reach it on the last step.",
    )
    schedule: str = _f(
        "linear",
        "Learning rate after warmup: linear, wsd or constant. linear decays from the peak to min_lr_ratio x peak over the rest of the run; wsd (warmup-stable-decay) holds the peak, then decays linearly over the last decay_frac of the run.",
        SCHEDULES,
    )
    weight_decay: float = _f(
        0.1, "Decoupled weight decay (AdamW and Muon), not applied to the embedding or the norms; >= 0."
    )
    beta1: float = _f(0.9, "Adam's first-moment decay (and Muon's momentum), in [0, 1).")
    beta2: float = _f(0.95, "Adam's second-moment decay, in [0, 1); with lr: auto the heuristic sets it instead.")
    grad_clip: float = _f(1.0, "Clip the gradients' global norm to this before the update; 0 = off.")
    muon_lr_ratio: float = _f(
        13 / 3, "Muon's learning rate over Adam's, with optimizer muon (Marin: 13/3). A number > 0."
    )
    decay_frac: float = _f(0.2, "The last fraction of the run that decays under the wsd schedule, in [0, 1].")
    log_every: int = _f(
        10, "Steps between lines of metrics.jsonl (and the progress line); the last step is always logged."
    )
    eval_every: int = _f(
        0,
        "Steps between held-out evaluations; 0 = every 5% of the run. Step 0 and the last step are always evaluated.",
    )
    eval_tokens: int = _f(8192, "Held-out tokens per domain per evaluation (the same windows every time).")
    checkpoint_every: int = _f(100, "Steps between checkpoints; the last step is always checkpointed.")
    keep_last: int = _f(
        2, "Newest checkpoints kept; older ones are deleted (unless keep_every or keep_steps keeps them)."
    )
    keep_every: int = _f(0, "Also keep every checkpoint at a multiple of this step for good; 0 = none.")
    keep_steps: tuple[int, ...] = _f(
        (), "Also checkpoint at these steps (in 1..steps) and keep them for good. Branch points for later runs."
    )
    nan_patience: int = _f(
        3,
        "Non-finite steps in a row (each skipped) before the run restores its last checkpoint.",
    )
    peak_flops: float = _f(
        0.0,
        "One device's peak FLOP/s in the compute dtype, for MFU. 0 = the published peak of a known accelerator (moelab.devices), or this CPU's measured matmul rate.",
    )
    poison_steps: tuple[int, ...] = _f((), "Testing aid: these steps' loss is made NaN, to exercise the NaN guard.")
    inject: tuple[str, ...] = _f(
        (),
        "Faults to inject, to test the health checks: KIND@STEP[:ARG]. Such as lr_spike@100:10; the kinds are in moelab.monitor.faults.",
    )
    replans: tuple[str, ...] = _f(
        (),
        "Horizon changes, AT:OLD->NEW steps (such as 150:300->450). Written by `moelab replan`; the last must end at steps.",
    )
    forecast_update_every: float = _f(
        0.1,
        "How often a joint-law forecast.json in the run is refit, as a fraction of the run; 0 = never. In [0, 1]; the refits use the run's own evaluations and are recorded beside the registered forecast, never over it.",
    )
    trackers: tuple[str, ...] = _f(
        (),
        "Trackers the metrics are mirrored to: wandb, tensorboard. `moelab train --tracker` adds to them; the run's own files stay the record.",
    )
    tracker_project: str = _f("", 'W&B project; "" = the environment\'s WANDB_PROJECT, else moelab.')
    tracker_entity: str = _f(
        "", "W&B entity (user or team); \"\" = the environment's WANDB_ENTITY, else W&B's default."
    )
    tracker_mode: str = _f(
        "",
        'W&B mode: online, offline or disabled; "" = the environment\'s WANDB_MODE, else offline.',
        ("", "online", "offline", "disabled"),
    )
    micro_batch: int = _f(
        0,
        "Sequences per micro-step (over all devices), for gradient accumulation; 0 = the whole batch. Must divide batch_size; the step runs batch_size / micro_batch micro-steps and one update, and metrics, drops, router balancing and z-losses are the whole batch's (moelab.train.step).",
    )
    offload: str = _f(
        "none",
        "Host offload (memory kind pinned_host): none, optimizer, layer_inputs or all. optimizer: AdamW/Muon state kept in host memory and moved in for the update; layer_inputs: with model.remat, each rematerialised block's (or layer's) input saved to host memory; all: both (Marin's strategy on GB200).",
        OFFLOADS,
    )
    failure_hours: float = _f(
        0.0,
        "Mean hours between failures of the job (a node, the network, a preemption: the whole cluster's rate) that you expect. > 0: after the first checkpoint the run prints Young/Daly's checkpoint interval for the save's measured cost and this rate, beside train.checkpoint_every. 0 = the save's cost alone.",
    )
    async_checkpoint: bool = _f(
        True, "Save checkpoints in the background while training goes on. false: the step waits for each save."
    )
    checkpoint_writer: str = _f(
        "thread",
        "Who writes a background checkpoint: thread (Orbax's background thread in the training process) or process (a process of its own at idle priority, from a copy of the state in shared memory; a single-process job). Measured on 2 cores with a 0.37 GB state: a step beside a save 3.95x (thread) and 1.80x (process) a step without one; the training guide compares them with a synchronous save.",
        CKPT_WRITERS,
    )
    checkpoint_dir: str = _f(
        "",
        "Where checkpoints go; \"\" = the run's ckpt/ folder. Else any path Orbax's file layer takes (such as gs://...).",
    )
    init_from: str = _f(
        "",
        'Start from a finished run\'s weights: "RUN:STEP" (its folder and checkpoint step), with this config\'s own optimizer (fresh), schedule and data; the model must have the parent\'s shapes. "hf:DIR" = a Hugging Face folder that `moelab export hf` wrote (or one in its layout). "" = from the seed. `moelab train --init-from RUN[:STEP]` (or DIR) sets it (the newest checkpoint by default).',
    )
    task_evals: tuple[str, ...] = _f(
        (),
        "Tasks scored at every evaluation: by log-likelihood (moelab.eval.tasks) or, for a file of prompts, by the completions the model writes (moelab.eval.generation: pass@k). Built-in names (next_line, brackets, defined_name) or JSON-lines task files.",
    )
    task_eval_examples: int = _f(
        100, "Examples per task at each evaluation in the loop, evenly spread over its file; 0 = all."
    )
    task_eval_samples: int = _f(
        1,
        "Completions per prompt of a generation task in train.task_evals: 1 = greedy (pass@1), k > 1 = k samples at temperature 0.8 (pass@1 and pass@k).",
    )

    def check(self) -> list[str]:
        """Problems with the training fields: one line each."""
        # long (84 lines): one rule per field, in the fields' order; split, each part would only list fields again
        t = self
        e: list[str] = []
        for n in ("steps", "batch_size", "log_every", "checkpoint_every", "keep_last", "eval_tokens", "nan_patience"):
            if getattr(t, n) <= 0:
                e.append(f"train.{n}: must be > 0, got {getattr(t, n)}")
        if isinstance(t.lr, str):
            if t.lr != "auto":
                e.append(f"train.lr: must be a number or 'auto', got {t.lr!r}")
        elif t.lr <= 0:
            e.append(f"train.lr: must be > 0, got {t.lr}")
        if not (isinstance(t.lr_scale, (int, float)) and t.lr_scale > 0):
            e.append(f"train.lr_scale: must be a number > 0, got {t.lr_scale!r}")
        if t.optimizer not in OPTIMIZERS:
            e.append(f"train.optimizer: must be adamw or muon, got {t.optimizer!r}")
        if t.schedule not in SCHEDULES:
            e.append(f"train.schedule: must be linear, wsd or constant, got {t.schedule!r}")
        if not 0.0 <= t.warmup_frac < 1.0:
            e.append(f"train.warmup_frac: must be in [0, 1), got {t.warmup_frac}")
        if not 0.0 <= t.min_lr_ratio <= 1.0:
            e.append(f"train.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
        if not 0 <= t.seed < 2**32:
            e.append(f"train.seed: must be in [0, 2**32), got {t.seed}")
        if not (t.data_seed == -1 or 0 <= t.data_seed < 2**32):
            e.append(f"train.data_seed: must be -1 (= train.seed) or in [0, 2**32), got {t.data_seed}")
        for n in ("weight_decay", "grad_clip", "eval_every", "keep_every", "peak_flops"):
            if getattr(t, n) < 0:
                e.append(f"train.{n}: must be >= 0, got {getattr(t, n)}")
        for spec in t.inject:
            try:
                fault = parse_fault(spec)
            except ValueError as exc:
                e.append(f"train.inject: {exc}")
                continue
            if t.steps > 0 and fault.step >= t.steps:
                e.append(f"train.inject: {spec!r}: step {fault.step} is past the run's last step {t.steps - 1}, so it "
                         "would never fire; give a step inside the run")  # fmt: skip
        if t.replans:
            try:
                parse_replans(t.replans, t.steps)
            except ValueError as exc:
                e.append(f"train.replans: {exc}")
        bad = [k for k in t.keep_steps if not (isinstance(k, int) and 0 < k <= t.steps)]
        if bad:
            e.append(f"train.keep_steps: steps to checkpoint must lie in 1..train.steps={t.steps}, got {bad[0]!r}")
        if not 0.0 <= t.decay_frac <= 1.0:
            e.append(f"train.decay_frac: must be in [0, 1], got {t.decay_frac}")
        bad = [x for x in t.trackers if x not in ("wandb", "tensorboard")]
        if bad:
            e.append(f"train.trackers: {', '.join(map(str, bad))} is not a tracker; use wandb or tensorboard")
        if t.tracker_mode not in ("", "online", "offline", "disabled"):
            e.append(f"train.tracker_mode: {t.tracker_mode!r}: use online, offline or disabled (or leave it empty)")
        if not 0.0 <= t.forecast_update_every <= 1.0:
            e.append(
                f"train.forecast_update_every: must be in [0, 1] (a fraction of the run), got {t.forecast_update_every}"
            )
        if t.task_eval_examples < 0:
            e.append(f"train.task_eval_examples: must be >= 0 (0 = every example), got {t.task_eval_examples}")
        if t.init_from and not (t.init_from.startswith("hf:") and t.init_from[3:].strip()):
            run, _, step = t.init_from.rpartition(":")
            if not run or not step.isdigit():
                e.append(
                    f'train.init_from: "{t.init_from}"; give RUN:STEP, a run folder and its checkpoint step, or hf:DIR'
                )
        if not t.failure_hours >= 0 or t.failure_hours == float("inf"):
            e.append(
                f"train.failure_hours: must be a finite number of hours >= 0 (0 = none given), got {t.failure_hours}"
            )
        if t.task_eval_samples < 1:
            e.append(f"train.task_eval_samples: must be >= 1 (1 = one greedy completion), got {t.task_eval_samples}")
        if not all(isinstance(x, str) and x.strip() for x in t.task_evals):
            e.append(f"train.task_evals: a list of built-in task names or task files, got {list(t.task_evals)!r}")
        if t.micro_batch < 0:
            e.append(f"train.micro_batch: must be >= 0 (0 = the whole batch), got {t.micro_batch}")
        elif t.micro_batch and t.batch_size > 0 and t.batch_size % t.micro_batch:
            e.append(
                f"train.micro_batch: {t.micro_batch} does not divide train.batch_size={t.batch_size}; "
                "use a divisor (or 0 for the whole batch)"
            )
        if t.checkpoint_writer not in CKPT_WRITERS:
            e.append(f"train.checkpoint_writer: must be thread or process, got {t.checkpoint_writer!r}")
        if t.offload not in OFFLOADS:
            e.append(f"train.offload: must be one of {', '.join(map(repr, OFFLOADS))}, got {t.offload!r}")
        if t.muon_lr_ratio <= 0:
            e.append(f"train.muon_lr_ratio: must be > 0, got {t.muon_lr_ratio}")
        for n in ("beta1", "beta2"):
            if not 0.0 <= getattr(t, n) < 1.0:
                e.append(f"train.{n}: must be in [0, 1), got {getattr(t, n)}")
        return e
