"""Task evaluations scored by log-likelihood: a small task format and its metrics.

A task is a JSON-lines file, one example per line, of either kind:

- multiple choice: ``{"context": str, "choices": [str, ...], "answer": int}``: the model's
  log-likelihood of each choice after the context; ``acc`` is 1 when the right choice has the
  highest, ``acc_norm`` when it has the highest per character of the choice (lm-evaluation-harness's
  ``acc_norm``, fair to choices of unequal length), ``acc_bytes`` per UTF-8 byte of it (lm-eval's
  ``acc_bytes``; the two differ where a choice holds characters beyond ASCII). Chance: the mean of 1 / choices.
- a target continuation: ``{"context": str, "continuation": str}``: the bits per byte of the
  continuation after the context (``-sum log p / ln 2 / its UTF-8 bytes``); lower is better.

A multiple-choice task also reports the bits per byte of its right answers. Ties in ``acc`` go
to the first choice with the highest score (so a model that scores every choice alike is right only
where the answer is choice 0, as chance says).

The log-likelihoods come from ``loglik(pairs) -> [nats]``: the summed log-probability of each
continuation's tokens after its context, for a list of (context, continuation) pairs
(``model_loglik`` builds one from a model; a test sets one by hand). A run's checkpoint is scored on
tasks by ``moelab.train.run_tasks`` (`moelab eval RUN --tasks` and ``--retrieval``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moelab.errors import UsageError
from moelab.eval.builtin import BUILTIN, GENERATION, builtin_task
from moelab.eval.generation import is_generation_file, load_gen_tasks
from moelab.jsonl import input_records
from moelab.model.transformer import ce_terms, forward


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...] = ()  # multiple choice; empty for a target continuation
    answer: int = -1
    continuation: str = ""


def load_task(path: str | Path, field: str = "--tasks") -> list[Example]:
    """The examples of a task file; a bad line is refused in one line naming the file and line
    (``field``: what named the file). Other keys of a line (such as "meta") are kept out of scoring."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{field}: {path}: no such task file (JSON lines; see moelab.eval.tasks)")
    out = []
    for where, rec in input_records(path, field, "example"):
        if not isinstance(rec, dict) or not isinstance(rec.get("context"), str):
            raise UsageError(f'{where}: needs a string "context"')
        if "choices" in rec:
            choices, answer = rec["choices"], rec.get("answer")
            if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
                raise UsageError(f'{where}: "choices" must be a list of two or more non-empty strings')
            if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)):
                raise UsageError(f'{where}: "answer" must be the index of the right choice, 0..{len(choices) - 1}')
            out.append(Example(rec["context"], tuple(choices), answer))
        elif isinstance(rec.get("continuation"), str) and rec["continuation"]:
            out.append(Example(rec["context"], continuation=rec["continuation"]))
        else:
            raise UsageError(f'{where}: give "choices" and "answer", or a non-empty "continuation"')
    if not out:
        raise UsageError(f"{field}: {path}: holds no example")
    return out


def _bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _best(values: Sequence[float]) -> int:
    """The index of the highest value, ties to the first (numpy's argmax, as lm-eval picks)."""
    return max(range(len(values)), key=lambda j: (values[j], -j))


def score(examples: Sequence[Example], loglik: Callable[[list[tuple[str, str]]], Sequence[float]]) -> dict:
    """A task's metrics from the log-likelihoods ``loglik`` gives (one call for every pair)."""
    pairs = []
    for ex in examples:
        pairs.extend((ex.context, c) for c in ex.choices) if ex.choices else pairs.append((ex.context, ex.continuation))
    ll = list(loglik(pairs))
    if len(ll) != len(pairs):
        raise ValueError(f"loglik gave {len(ll)} values for {len(pairs)} pairs")
    acc = acc_norm = acc_bytes = chance = 0.0
    n_mc = 0
    nats = n_bytes = 0.0
    k = 0
    for ex in examples:
        if ex.choices:
            got = ll[k : k + len(ex.choices)]
            k += len(ex.choices)
            acc += _best(got) == ex.answer
            acc_norm += _best([g / max(len(c), 1) for g, c in zip(got, ex.choices, strict=True)]) == ex.answer
            acc_bytes += _best([g / _bytes(c) for g, c in zip(got, ex.choices, strict=True)]) == ex.answer
            chance += 1 / len(ex.choices)
            n_mc += 1
            nats -= got[ex.answer]
            n_bytes += _bytes(ex.choices[ex.answer])
        else:
            nats -= ll[k]
            k += 1
            n_bytes += _bytes(ex.continuation)
    out = {"examples": len(examples), "bpb": nats / math.log(2) / n_bytes}
    if n_mc:
        out.update(acc=acc / n_mc, acc_norm=acc_norm / n_mc, acc_bytes=acc_bytes / n_mc, chance=chance / n_mc,
                   multiple_choice=n_mc)  # fmt: skip
    return out


def model_loglik(params, model_state, m, tok, batch: int = 8) -> Callable[[list[tuple[str, str]]], list[float]]:
    """``loglik`` from a moelab model: each context starts as a document does (after the bos where the
    tokenizer puts one, else after the end-of-text that ends the document before), context and
    continuation are tokenized apart (``add_special_tokens`` off), and the continuation's tokens are
    scored. A pair longer than the model's context keeps its last ``seq_len + 1`` tokens (the context
    is cut at its start). Scored with dropless dispatch, so a row's padding, or the other rows of its
    batch, cannot change it (capacity would make them compete for slots)."""
    start = tok.bos if tok.add_bos and tok.bos is not None else tok.eos
    width = m.seq_len
    rows = _row_scores(m)

    def encode(text: str) -> list[int]:
        return tok.tokenizer.encode(text, add_special_tokens=False).ids

    def loglik(pairs: list[tuple[str, str]]) -> list[float]:
        seqs = []
        for context, continuation in pairs:
            target = encode(continuation)
            ids = ([start] + encode(context) + target)[-(width + 1) :]
            seqs.append((ids, min(len(target), len(ids) - 1)))
        out: list[float] = []
        for i in range(0, len(seqs), batch):
            chunk = seqs[i : i + batch]
            inputs, targets = np.zeros((batch, width), np.int32), np.zeros((batch, width), np.int32)
            mask = np.zeros((batch, width), np.float32)
            for r, (ids, n) in enumerate(chunk):
                k = len(ids) - 1
                inputs[r, :k], targets[r, :k], mask[r, k - n : k] = ids[:-1], ids[1:], 1.0
            out.extend(np.asarray(rows(params, model_state, inputs, targets, mask))[: len(chunk)].tolist())
        return out

    return loglik


@functools.lru_cache(maxsize=8)
def _row_scores(m):
    """Each row's summed log-probability of its masked targets, jitted once per model config (an
    in-loop evaluation reuses it)."""

    @jax.jit
    def rows(params, state, inputs, targets, mask):
        hidden, _, _ = forward(params, state, inputs, m, "dropless")
        lse, tgt = ce_terms(params, hidden, targets, m.ce_chunk)
        return jnp.sum((tgt - lse) * mask, axis=1)

    return rows


def load_tasks(specs: Sequence[str], field: str = "--tasks") -> dict[str, list]:
    """Tasks by name: a built-in task's name (moelab.eval.builtin) or a JSON-lines file; every one is
    read (and a bad one refused) before anything is scored. A file of generation tasks (its lines have a
    "prompt": moelab.eval.generation) gives GenTasks, any other Examples."""
    out = {}
    for spec in specs:
        path = Path(spec)
        if not path.exists() and "/" not in spec and not spec.endswith(".jsonl"):
            if spec not in BUILTIN + GENERATION:
                raise UsageError(
                    f"{field}: {spec!r} is neither a task file nor a built-in task ({', '.join(BUILTIN + GENERATION)})"
                )
            path = builtin_task(spec)
        read = load_gen_tasks if is_generation_file(path) else load_task
        out[path.stem if path.exists() and spec != path.stem else spec] = read(path, field)
    return out
