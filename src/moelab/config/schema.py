"""A config as a whole: its four sections (model, train, data, mesh) and its name, the checks that
span sections, and the views derived from it (the phases' configs, the data seed, the dtype that runs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moelab.config.data import DataConfig
from moelab.config.fields import BYTE_LEVEL_BASE, _f
from moelab.config.model import ModelConfig, auto_dtype
from moelab.config.train import TrainConfig
from moelab.errors import ConfigError


@dataclass(frozen=True)
class MeshConfig:
    data: int = _f(1, "Devices along the mesh's data axis: each holds a share of the batch's sequences.")
    expert: int = _f(
        1,
        "Devices along the mesh's expert axis (expert parallelism). Each holds n_routed / expert routed experts and a share of the batch; must divide model.n_routed. mesh.data x mesh.expert = the devices a run uses.",
    )
    fsdp: bool = _f(
        True,
        "Shard parameters, gradients and optimizer state over the data axis too (ZeRO-3). Experts are also sharded over the expert axis; false = replicated over data.",
    )


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(
        default_factory=ModelConfig,
        metadata={"help": "The network: its shape, attention, experts, router, dispatch, numerics and memory options."},
    )
    train: TrainConfig = field(
        default_factory=TrainConfig,
        metadata={
            "help": "The run: steps and batch, optimizer and learning-rate schedule, evaluation, checkpoints, "
            "trackers and memory placement."
        },
    )
    data: DataConfig = field(
        default_factory=DataConfig,
        metadata={
            "help": "What the model reads: sources and domains, the tokenizer, the held-out split, the mixture and "
            "its phases."
        },
    )
    mesh: MeshConfig = field(
        default_factory=MeshConfig,
        metadata={"help": "How the run spreads over devices: the data and expert axes, and FSDP sharding."},
    )
    name: str = _f(
        "", "A label for the config, shown by commands such as flops. A preset sets its own name; a file may set one."
    )

    def check_vocab(self) -> list[str]:
        """A tokenizer trained here is byte-level: its 256 bytes and the end-of-text token come first."""
        v = self.model.vocab_size
        if not self.data.tokenizer and 0 < v < BYTE_LEVEL_BASE:
            return [
                f"model.vocab_size: {v} is below the {BYTE_LEVEL_BASE} tokens a byte-level tokenizer starts "
                f"with (256 bytes and end-of-text); use {BYTE_LEVEL_BASE} or more"
            ]
        return []

    def check_mesh(self) -> list[str]:
        """Problems with the mesh, against the model and the batch (across sections): one line each."""
        cfg = self
        e: list[str] = []
        for n in ("data", "expert"):
            if getattr(cfg.mesh, n) <= 0:
                e.append(f"mesh.{n}: must be > 0, got {getattr(cfg.mesh, n)}")
        group, tokens = cfg.model.capacity_group, cfg.train.batch_size * cfg.model.seq_len
        if group > 0 and tokens > 0 and tokens % group:
            e.append(
                f"model.capacity_group: {group} does not divide the batch's {tokens} tokens "
                f"(train.batch_size x model.seq_len); use a divisor such as model.seq_len"
            )
        shards = cfg.mesh.data * cfg.mesh.expert
        mesh_ok = (
            cfg.mesh.expert > 0
            and cfg.mesh.data > 0
            and not (cfg.model.n_routed > 0 and cfg.model.n_routed % cfg.mesh.expert)
        )
        if mesh_ok and cfg.train.batch_size > 0 and cfg.train.batch_size % shards:
            e.append(
                f"train.batch_size: {cfg.train.batch_size} sequences do not split over mesh.data x mesh.expert = "
                f"{shards} devices; use a multiple of {shards}"
            )
        if cfg.train.offload in ("layer_inputs", "all") and cfg.model.remat == "none":
            e.append(
                f"train.offload: {cfg.train.offload} keeps each rematerialised block's input in host memory; "
                "set model.remat=layer or each_layer (or train.offload=optimizer)"
            )
        mb = cfg.train.micro_batch
        if mesh_ok and mb > 0 and cfg.train.batch_size % max(mb, 1) == 0 and mb % shards:
            e.append(
                f"train.micro_batch: {mb} sequences do not split over mesh.data x mesh.expert = {shards} devices; "
                f"use a multiple of {shards}"
            )
        if group > 0 and mb > 0 and (mb * cfg.model.seq_len) % group:
            e.append(
                f"model.capacity_group: {group} does not divide a micro-batch's {mb * cfg.model.seq_len} tokens "
                f"(train.micro_batch x model.seq_len); capacity groups are formed within a micro-batch"
            )
        if cfg.mesh.expert > 0 and cfg.model.n_routed > 0 and cfg.model.n_routed % cfg.mesh.expert:
            e.append(f"mesh.expert: {cfg.mesh.expert} does not divide model.n_routed={cfg.model.n_routed}")
        if cfg.mesh.expert > 1:
            e.extend(cfg._check_ep())
        return e

    def check_context(self) -> list[str]:
        """data.phase_seq_lens against the phases and model.seq_len: one line each."""
        lens, m = list(self.data.phase_seq_lens), self.model
        phases = len(self.data.phase_starts)
        if not lens or m.seq_len <= 0:
            return []
        where = f"data.phase_seq_lens: {lens}"
        if len(lens) not in (1, phases):
            return [f"{where}: give 1 length or one per phase ({phases} data.phase_starts)"]
        if any(x <= 0 for x in lens):
            return [f"{where}: every length must be > 0"]
        if any(b < a for a, b in zip(lens, lens[1:], strict=False)):
            return [f"{where}: lengths must not fall from phase to phase (a long-context phase comes late)"]
        if max(lens) != m.seq_len:
            return [
                f"{where}: the longest must equal model.seq_len={m.seq_len} (the model's context); set one or the other"
            ]
        if bad := [x for x in lens if m.seq_len % x or x % lens[0]]:
            return [
                f"{where}: {bad[0]} must divide model.seq_len={m.seq_len} and be a multiple of the first length {lens[0]}"
            ]
        if m.rope_original_len:
            return [f"model.rope_original_len: {m.rope_original_len} with {where}: the phases set it; leave it 0"]
        return []

    def _check_ep(self) -> list[str]:
        """Under expert parallelism the transport does the dispatch: a setting it would not honour is refused."""
        cfg = self
        m, e = cfg.model, []
        allowed = {"dropless": ("fixed",), "capacity": ("fixed", "pooled_wave"), "spill": ("spill",)}.get(
            m.dispatch, ()
        )
        if allowed and m.ep_transport not in allowed:
            why = {
                "dropless": "dropless exchanges every assignment; the transport matters to capacity and spill only",
                "capacity": "the spill transport would move overflow to next-ranked experts: set model.dispatch=spill",
                "spill": "only the spill transport spills; set model.ep_transport=spill",
            }[m.dispatch]
            e.append(
                f"model.ep_transport: {m.ep_transport} with model.dispatch={m.dispatch} under expert parallelism: {why}"
            )
        shards = cfg.mesh.data * cfg.mesh.expert
        per_device = cfg.train.batch_size * m.seq_len // shards if shards > 0 else 0
        if m.capacity_group not in (0, per_device):
            e.append(
                f"model.capacity_group: under expert parallelism each device's {per_device} tokens are one capacity "
                f"group; set 0 (or {per_device})"
            )
        if m.drop_order == "score" and m.ep_transport == "pooled_wave":
            e.append(
                "model.drop_order: pooled_wave fills receivers round-robin, not by score; use position, or fixed/spill"
            )
        return e


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "mesh": MeshConfig}


def validate(cfg: Config) -> Config:
    """``cfg`` if every section's checks and the cross-section checks pass; else a ConfigError listing
    every problem."""
    errors = cfg.model.check() + cfg.train.check() + cfg.data.check() + cfg.check_mesh() + cfg.check_context()
    if errors:
        raise ConfigError(errors)
    return cfg


def data_seed(cfg: Config) -> int:
    """The seed of ``cfg``'s data order: ``train.data_seed``, or ``train.seed`` where it is -1."""
    return cfg.train.seed if cfg.train.data_seed == -1 else cfg.train.data_seed


def resolve_dtype(cfg: Config, backend: str | None = None) -> Config:
    """``cfg`` with ``compute_dtype: auto`` replaced by what runs on ``backend`` (None = here): a run
    records, hashes and checkpoints the dtype it computed in."""
    if cfg.model.compute_dtype != "auto":
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype=auto_dtype(backend)))


def phase_seq_lens(cfg: Config) -> tuple[int, ...]:
    """The sequence length of each phase of the run (data.phase_seq_lens, one per data.phase_starts)."""
    lens = tuple(cfg.data.phase_seq_lens) or (cfg.model.seq_len,)
    return lens * len(cfg.data.phase_starts) if len(lens) == 1 else lens


def phase_config(cfg: Config, phase: int) -> Config:
    """The config a phase's steps run: model.seq_len the phase's length, RoPE scaled from the first
    phase's length when longer (model.rope_original_len), and train.batch_size (and micro_batch) the
    sequences that hold the batch's tokens (train.batch_size x model.seq_len) at that length."""
    lens = phase_seq_lens(cfg)
    length, first = lens[phase], lens[0]
    if length == cfg.model.seq_len and first == length:
        return cfg
    per = cfg.model.seq_len // length
    t = dataclasses.replace(cfg.train, batch_size=cfg.train.batch_size * per, micro_batch=cfg.train.micro_batch * per)
    m = dataclasses.replace(cfg.model, seq_len=length, rope_original_len=first if length > first else 0)
    # a config of its own (it validates): one length throughout, RoPE's original length set
    return dataclasses.replace(cfg, model=m, train=t, data=dataclasses.replace(cfg.data, phase_seq_lens=()))


def final_model(cfg: Config) -> ModelConfig:
    """The model as trained at the end of the run (the last phase's context and RoPE): what sampling,
    task evaluations and the export use."""
    return phase_config(cfg, len(phase_seq_lens(cfg)) - 1).model
