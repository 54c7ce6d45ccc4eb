"""The data section of a config: sources and domains, the tokenizer, the held-out split, the mixture
and its phases, each field with its meaning, and the checks of its own fields."""

from __future__ import annotations

from dataclasses import dataclass

from moelab.config.fields import _f


@dataclass(frozen=True)
class DataConfig:
    sources: tuple[str, ...] | dict[str, tuple[str, ...]] = _f(
        ("stdlib",),
        "What to train on: a list of sources, or a mapping of domain names to lists of paths. A source is 'stdlib', 'cheaders', a path or glob (a file, a folder, '/data/**/*.parquet') or 'name=path-or-glob' (entries with one name make one domain); see moelab.data.sources. Text, JSON lines, parquet and arrow, any compression.",
    )
    tokenizer: str = _f(
        "",
        'A tokenizer.json, or a folder holding one (a transformers model folder). "" = train a byte-level BPE of model.vocab_size tokens on the sources.',
    )
    text_field: str | dict[str, str] = _f(
        "text",
        "The field of JSON-lines, parquet and arrow records that holds the text. Or a mapping of domain names to fields.",
    )
    validation: tuple[str, ...] | dict[str, tuple[str, ...]] = _f(
        (),
        "Sources never trained on, evaluated beside the held-out split (the same forms as sources).",
    )
    bad_records: str = _f(
        "refuse",
        "What a bad shard, line or row does: refuse (stops the build) or skip (left out and counted).",
        ("refuse", "skip"),
    )
    workers: int = _f(
        0, "Processes that tokenize the shards; 0 = every core. The token store's bytes do not depend on it."
    )
    backend: str = _f(
        "local",
        "Where the shards are tokenized: local or ray. local: processes here; ray: one Ray task per unit of shards.",
        ("local", "ray"),
    )
    include: tuple[str, ...] = _f(
        (), "Folder sources: globs of the files to read; empty = every text file. Such as ['*.py', 'lib/**']."
    )
    exclude: tuple[str, ...] = _f((), "Folder sources: globs of the files to leave out.")
    held_out_fraction: float = _f(
        0.02,
        "Share of each domain's documents held out for evaluation, in [0, 1); 0 = none. A document is held out by a stable hash of its domain and name; a domain of few documents is split by position.",
    )
    max_bytes_per_domain: int = _f(
        0, "Bytes of text per domain: past this no more documents are added; 0 = every document."
    )
    mixture: tuple[dict[str, float], ...] = _f(
        (),
        "Domain weights, one mapping per phase; empty = each domain in proportion to its tokens. A single mapping applies to every phase; weights >= 0 with a positive sum.",
    )
    phase_starts: tuple[float, ...] = _f(
        (0.0, 0.8),
        "Where each phase of the mixture starts, as fractions of the run: 0.0 first, rising, below 1.0.",
    )
    phase_seq_lens: tuple[int, ...] = _f(
        (),
        "The sequence length of each phase: a long-context phase. Empty = model.seq_len throughout; one value = every phase. The longest must equal model.seq_len and lengths must not fall. The batch's tokens are held (train.batch_size counts sequences of model.seq_len), so a shorter phase holds more sequences; RoPE is scaled by length / the first length in a longer phase (model.rope_scaling), and the model samples and exports at the last.",
    )
    packing: str = _f(
        "packed",
        "How documents fill the rows of a batch: packed (end to end, each attending only within itself where the store holds conversations) or padded (one document a row from its start, cut past model.seq_len + 1 tokens, the rest padding outside the loss; a domain's pass is then one row per document). padded takes one sequence length (no data.phase_seq_lens).",
        ("packed", "padded"),
    )
    epoch_cap: float = _f(4.0, "Most passes over any domain's training tokens that the mixture may need; > 0.")
    epoch_cap_action: str = _f(
        "refuse",
        "What a mixture past epoch_cap does: refuse (the run stops before training) or warn.",
        ("refuse", "warn"),
    )

    def check(self) -> list[str]:
        """Problems with the data fields: one line each."""
        d = self
        e: list[str] = []
        for name in ("sources", "validation"):
            given = getattr(d, name)
            entries = [x for v in given.values() for x in v] if isinstance(given, dict) else list(given)
            if isinstance(given, dict) and any(not str(k).strip() or not v for k, v in given.items()):
                e.append(f"data.{name}: every domain needs a name and at least one path, got {dict(given)!r}")
            elif any(not str(x).strip() for x in entries):
                e.append(
                    f"data.{name}: an empty source (an unset shell variable?) in {list(entries)!r}; "
                    "name a file, a folder, a glob or 'stdlib'"
                )
        if not d.sources:
            e.append("data.sources: name at least one source (a path or 'stdlib')")
        if isinstance(d.text_field, dict) and not all(str(v).strip() for v in d.text_field.values()):
            e.append(f"data.text_field: every domain's field must be named, got {dict(d.text_field)!r}")
        if d.bad_records not in ("refuse", "skip"):
            e.append(f"data.bad_records: must be refuse or skip, got {d.bad_records!r}")
        if d.packing not in ("packed", "padded"):
            e.append(f"data.packing: must be packed or padded, got {d.packing!r}")
        elif d.packing == "padded" and len(set(d.phase_seq_lens)) > 1:
            e.append("data.packing: padded takes one sequence length; drop data.phase_seq_lens or pack the documents")
        if d.workers < 0:
            e.append(f"data.workers: must be >= 0 (0 = every core), got {d.workers}")
        if d.backend not in ("local", "ray"):
            e.append(f"data.backend: must be local or ray, got {d.backend!r}")
        for name in ("include", "exclude"):
            globs = getattr(d, name)
            if not all(isinstance(g, str) and g.strip() for g in globs):
                e.append(f"data.{name}: a list of file globs such as ['*.pl', 'lib/**'], got {list(globs)!r}")
        if isinstance(d.text_field, str) and not d.text_field.strip():
            e.append("data.text_field: must name the field that holds a document's text (default 'text')")
        if not 0.0 <= d.held_out_fraction < 1.0:
            e.append(f"data.held_out_fraction: must be in [0, 1), got {d.held_out_fraction}")
        if d.max_bytes_per_domain < 0:
            e.append(f"data.max_bytes_per_domain: must be >= 0, got {d.max_bytes_per_domain}")
        starts = list(d.phase_starts)
        if (
            not starts
            or starts[0] != 0.0
            or any(b <= a for a, b in zip(starts, starts[1:], strict=False))
            or starts[-1] >= 1.0
        ):
            e.append(f"data.phase_starts: must start at 0.0 and rise below 1.0, got {starts}")
        if len(d.mixture) not in (0, 1, len(starts)):
            e.append(
                f"data.mixture: {len(d.mixture)} phases of weights for {len(starts)} data.phase_starts; give 1 or {len(starts)}"
            )
        for i, weights in enumerate(d.mixture):
            if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
                e.append(f"data.mixture[{i}]: weights must be >= 0 with a positive sum, got {weights}")
        if d.epoch_cap <= 0:
            e.append(f"data.epoch_cap: must be > 0, got {d.epoch_cap}")
        if d.epoch_cap_action not in ("refuse", "warn"):
            e.append(f"data.epoch_cap_action: must be refuse or warn, got {d.epoch_cap_action!r}")
        return e
