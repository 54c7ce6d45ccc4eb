"""Built-in task evaluations, made offline from held-out text of the demo corpus (the standard library).

Every example is cut from documents that the data pipeline holds out of training: the ``stdlib``
source's documents (``moelab.data.sources``: same domains, same document ids, documents longer than
``MAX_PIECE_CHARS`` cut into the same pieces, empty ones skipped, as the token store does) for which
``is_held_out(domain, doc_id, fraction)`` is true at the default ``data.held_out_fraction`` (0.02). The
split is a hash of the domain and the id, so a run holds these documents out whatever its Python
version, as long as its fraction is at least 0.02. The shipped files come from the Python named in
``data/tasks.json`` (with a hash of every source document); ``python -m moelab.eval.builtin``
regenerates them, the same bytes for the same seed and the same standard library.

The multiple-choice tasks (files in ``data/``, the task format of ``moelab.eval.tasks``): ``next_line``,
``brackets`` and ``defined_name``, made by ``moelab.eval.code_tasks`` (what each asks, and how its
distractors are chosen, is written there).

Held-out files that dozens of training files repeat almost line for line (the character-map codecs
written by gencodec.py) are left out (``near_copy``): a task on them would measure recall of the
training files.

The long-context task, ``retrieval`` (chance 25%), is generated on demand for a run's tokenizer
(``retrieval_examples``, ``write_retrieval``): filler of held-out code (or prose) with one key line
``secret_<word> = <5 digits>`` planted at a chosen depth (the share of the filler before it: 0.0 at the
start, 1.0 at the end), then ``assert secret_<word> ==``; choices: the planted number and three numbers
found nowhere in the context.

Use: ``builtin_task(name) -> Path`` (a shipped file), ``task_path(name_or_path) -> Path``;
``retrieval_examples(n, length, depths, seed, filler_source, encode) -> [dict]`` and
``write_retrieval(folder, encode, lengths, depths, n, seed, filler_source) -> [Path]``; regenerate the
shipped files with ``python -m moelab.eval.builtin [--out DIR] [--seed N] [--n N]``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from moelab.config import DataConfig
from moelab.data import sources as S
from moelab.errors import UsageError
from moelab.eval.code_tasks import BRACKET_CHOICES, DESCRIPTIONS, MAKERS, Source, place
from moelab.progress import say

DATA = Path(__file__).parent / "data"
MANIFEST = "tasks.json"
BUILTIN = ("next_line", "brackets", "defined_name")
GENERATION = ("doctests",)  # code generation, made from installed packages: moelab.eval.doctest_tasks
CODE_DOMAINS = ("stdlib-code", "stdlib-tests")
PROSE_DOMAINS = ("stdlib-docs",)
SEED = 0
N_EXAMPLES = 240  # per multiple-choice task: divisible by 3 and 4, so answers balance exactly
RETRIEVAL_LENGTHS = (256, 512, 1024, 2048)  # tokens of context, with a run's tokenizer
RETRIEVAL_DEPTHS = (0.1, 0.5, 0.9)
RETRIEVAL_N = 8  # examples per (length, depth)
WORDS = (
    "amber", "anchor", "apple", "arrow", "badger", "basket", "beacon", "birch", "bottle", "bridge",
    "cactus", "candle", "canyon", "castle", "cedar", "cherry", "cobalt", "comet", "copper", "coral",
    "cotton", "dragon", "falcon", "feather", "fossil", "garden", "glacier", "granite", "harbor", "hazel",
    "helmet", "island", "jasmine", "kettle", "lantern", "lemon", "magnet", "maple", "marble", "meadow",
    "mirror", "nectar", "oyster", "paddle", "pepper", "pillow", "planet", "pebble", "quartz", "rabbit",
    "ribbon", "saddle", "salmon", "silver", "spruce", "tiger", "tulip", "velvet", "walnut", "willow",
)  # fmt: skip


# ---------------------------------------------------------------- the held-out documents


def default_fraction() -> float:
    return DataConfig().held_out_fraction


@functools.lru_cache(maxsize=8)
def heldout_documents(domains: tuple[str, ...] = CODE_DOMAINS, fraction: float | None = None) -> tuple:
    """(domain, doc_id, text) of the ``stdlib`` source's held-out documents in the given domains, in
    the pipeline's order: its documents (``iter_documents``), empty ones skipped, cut into the store's
    pieces, kept where ``is_held_out`` says so."""
    fraction = default_fraction() if fraction is None else fraction
    out = []
    for dom in S.resolve(["stdlib"]):
        if dom.name not in domains:
            continue
        for doc in S.iter_documents(dom):
            if not doc.text.strip():
                continue
            for piece in S.pieces(doc, S.MAX_PIECE_CHARS):
                if S.is_held_out(dom.name, piece.doc_id, fraction):
                    out.append((dom.name, piece.doc_id, piece.text))
    if not out:
        raise UsageError(f"no held-out document in {', '.join(domains)} at held_out_fraction {fraction}")
    return tuple(out)


def near_copy(text: str) -> bool:
    """A machine-made file that dozens of training files repeat almost line for line (the character
    map codecs that gencodec.py writes): held out by name, not in content, so no task uses it."""
    return "with gencodec.py" in text[:300]


def task_documents(domains: tuple[str, ...] = CODE_DOMAINS, fraction: float | None = None) -> list[tuple]:
    """The held-out documents the tasks are made from: ``heldout_documents`` less the near copies."""
    return [d for d in heldout_documents(domains, fraction) if not near_copy(d[2])]


# ---------------------------------------------------------------- retrieval (long context)


def _filler_texts(filler_source: str | Iterable[str], fraction: float | None) -> list[str]:
    if isinstance(filler_source, str):
        if filler_source not in ("code", "prose"):
            raise UsageError(f"filler_source: code, prose or a list of texts, not {filler_source!r}")
        domains = CODE_DOMAINS if filler_source == "code" else PROSE_DOMAINS
        return [text for _, _, text in task_documents(domains, fraction)]
    texts = [t for t in filler_source if t.strip()]
    if not texts:
        raise UsageError("filler_source: no text")
    return texts


def _filler_lines(texts: Sequence[str], rng: random.Random):
    """Lines (each ending in a newline) of the texts in a shuffled order from a random line on, cycled."""
    order = list(range(len(texts)))
    rng.shuffle(order)
    first = True
    while True:
        for i in order:
            lines = [ln + "\n" for ln in texts[i].rstrip("\n").split("\n")]
            if first:  # from a random line that is not blank
                lines = lines[rng.choice([k for k, ln in enumerate(lines) if ln.strip()]) :]
                first = False
            yield from lines


def retrieval_examples(
    n: int,
    length: int,
    depths: Sequence[float] = RETRIEVAL_DEPTHS,
    seed: int = SEED,
    filler_source: str | Iterable[str] = "code",
    encode: Callable[[str], list[int]] | None = None,
    fraction: float | None = None,
) -> list[dict]:
    """``n`` examples per depth of a context ``length`` long: tokens of ``encode`` when given (the
    context's token count at most ``length``, within a filler line of it), else characters.

    Each context is filler lines (held-out ``code`` or ``prose`` of the standard library, or the texts
    given), the key line ``secret_<word> = <5 digits>`` at ``depth`` (the share of the filler before
    it, in the same unit: 0.0 puts it first, 1.0 last), then ``assert secret_<word> ==``; choices: the
    planted number and three five-digit numbers found nowhere in the context, each after a space. Each
    example's ``meta``: depth (asked), actual_depth (measured), length (asked), unit, context_chars,
    context_tokens (when ``encode`` is given), key_offset (the character where the key line starts),
    key_line. The same arguments give the same examples."""
    if encode is None:

        def count(s: str) -> int:
            return len(s)

    else:

        def count(s: str) -> int:
            return len(encode(s))

    texts = _filler_texts(filler_source, fraction)
    out = []
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise UsageError(f"retrieval depth must be in [0, 1], got {depth}")
        for i in range(n):
            rng = random.Random(f"retrieval:{seed}:{length}:{depth}:{i}")
            out.append(_retrieval_one(rng, texts, length, depth, count, encode is not None))
    return out


def _retrieval_one(rng: random.Random, texts, length: int, depth: float, count, tokens: bool) -> dict:
    word = rng.choice(WORDS)
    number = rng.randrange(10000, 100000)
    key = f"secret_{word} = {number}\n"
    question = f"assert secret_{word} =="
    budget = length - count(key) - count(question)
    if budget < 0:
        raise UsageError(f"retrieval: a context of {length} {'tokens' if tokens else 'characters'} is too short")
    lines: list[str] = []
    it = _filler_lines(texts, rng)
    chars, need = 0, (4 if tokens else 1) * budget + 1
    while True:  # enough filler: more than the budget
        while chars < need:
            lines.append(next(it))
            chars += len(lines[-1])
        if count("".join(lines)) > budget:
            break
        need *= 2
    prefix = [0]
    for ln in lines:
        prefix.append(prefix[-1] + len(ln))
    text = "".join(lines)

    @functools.cache
    def t(k: int) -> int:  # the count of the first k lines
        return count(text[: prefix[k]])

    def last_within(limit: float, hi: int) -> int:  # the most lines whose count is at most limit
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if t(mid) <= limit else (lo, mid - 1)
        return lo

    m = last_within(budget, len(lines))
    while True:
        want = depth * t(m)
        a = last_within(want, m)
        if a < m and abs(t(a + 1) - want) < abs(t(a) - want):
            a += 1
        context = text[: prefix[a]] + key + text[prefix[a] : prefix[m]] + question
        if count(context) <= length or m == 0:
            break
        m -= 1  # the joins merged differently: one filler line less
    filler = text[: prefix[m]]
    others: list[int] = []
    while len(others) < 3:
        x = rng.randrange(10000, 100000)
        if x != number and x not in others and str(x) not in context:
            others.append(x)
    if str(number) in filler or f"secret_{word}" in filler:  # planted once: a clash gets another draw
        return _retrieval_one(random.Random(rng.random()), texts, length, depth, count, tokens)
    pos = rng.randrange(4)
    choices = [f" {x}" for x in place(number, others, pos)]
    before, after = count(text[: prefix[a]]), count(text[prefix[a] : prefix[m]])
    meta = {
        "depth": depth,
        "actual_depth": before / (before + after) if before + after else 0.0,
        "length": length,
        "unit": "tokens" if tokens else "chars",
        "context_chars": len(context),
        "key_offset": prefix[a],
        "key_line": key.rstrip("\n"),
    }
    if tokens:
        meta["context_tokens"] = count(context)
    return {"context": context, "choices": choices, "answer": pos, "meta": meta}


def write_retrieval(
    folder: str | Path,
    encode: Callable[[str], list[int]] | None = None,
    lengths: Sequence[int] = RETRIEVAL_LENGTHS,
    depths: Sequence[float] = RETRIEVAL_DEPTHS,
    n: int = RETRIEVAL_N,
    seed: int = SEED,
    filler_source: str | Iterable[str] = "code",
) -> list[Path]:
    """One task file per (length, depth), ``retrieval_L<length>_d<depth>.jsonl`` in ``folder``
    (loadable by ``load_task``; the file's stem names the task): ``n`` examples each."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for length in lengths:
        for depth in depths:
            rows = retrieval_examples(n, length, (depth,), seed, filler_source, encode)
            path = folder / f"retrieval_L{length}_d{depth:g}.jsonl"
            _write_jsonl(path, rows)
            paths.append(path)
    return paths


# ---------------------------------------------------------------- the shipped files


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def generate(out: str | Path = DATA, seed: int = SEED, n: int = N_EXAMPLES, progress: bool = True) -> dict:
    """Write the three tasks and their manifest (``tasks.json``) into ``out``; return the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fraction = default_fraction()
    docs = task_documents(CODE_DOMAINS, fraction)
    sources = [Source(*d) for d in docs]
    left_out = [f"{d}/{i}" for d, i, t in heldout_documents(CODE_DOMAINS, fraction) if near_copy(t)]
    manifest: dict = {
        "generated_by": "python -m moelab.eval.builtin",
        "seed": seed,
        "python": ".".join(map(str, sys.version_info[:3])),
        "corpus": "stdlib",
        "domains": list(CODE_DOMAINS),
        "held_out_fraction": fraction,
        "held_out_rule": "moelab.data.sources.is_held_out(domain, doc_id, fraction): held out by every run "
        "whose data.held_out_fraction is at least this",
        "documents": {f"{d}/{i}": _sha(t) for d, i, t in docs},
        "left_out": {"documents": left_out, "why": "near copies of training files (codecs written by gencodec.py)"},
        "tasks": {},
    }
    for name in BUILTIN:
        rows = MAKERS[name](sources, n, random.Random(f"{name}:{seed}"))
        _write_jsonl(out / f"{name}.jsonl", rows)
        k = len(rows[0]["choices"])
        answers = [r["answer"] for r in rows]
        dist = {str(j): answers.count(j) for j in range(k)}
        majority = max(dist.values()) / len(rows)
        entry = {
            "file": f"{name}.jsonl",
            "description": DESCRIPTIONS[name],
            "kind": "multiple_choice",
            "choices": k,
            "chance": 1 / k,
            "majority_rate": majority,
            "answers": dist if name != "brackets" else {BRACKET_CHOICES[int(j)]: c for j, c in dist.items()},
            # what picking by length alone scores (ties to the first choice): near chance
            "longest_choice_rate": _by_length(rows, max),
            "shortest_choice_rate": _by_length(rows, min),
            "n_examples": len(rows),
            "source_documents": sorted({f"{r['meta']['domain']}/{r['meta']['doc']}" for r in rows}),
            "how": (MAKERS[name].__name__ + f"(held-out stdlib code, random.Random('{name}:{seed}'))"),
        }
        manifest["tasks"][name] = entry
        say(f"{name}: {len(rows)} examples, chance {1 / k:.3f}, majority answer {majority:.3f} -> {out / entry['file']}",
            progress)  # fmt: skip
    manifest["tasks"]["retrieval"] = {
        "kind": "multiple_choice, generated on demand for a run's tokenizer (not shipped)",
        "description": "a key line secret_<word> = <5 digits> planted at a depth of a long filler context, "
        "asked for at the end (assert secret_<word> ==)",
        "chance": 0.25,
        "lengths": list(RETRIEVAL_LENGTHS),
        "depths": list(RETRIEVAL_DEPTHS),
        "n_per_cell": RETRIEVAL_N,
        "how": "moelab.eval.builtin.write_retrieval(folder, encode) / retrieval_examples(n, length, depths, seed, "
        "filler_source, encode)",
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def _by_length(rows: list[dict], pick) -> float:
    """The accuracy of always choosing the longest (``max``) or shortest (``min``) choice."""
    sign = 1 if pick is max else -1
    right = sum(
        max(range(len(r["choices"])), key=lambda j: (sign * len(r["choices"][j]), -j)) == r["answer"] for r in rows
    )
    return right / len(rows)


def builtin_task(name: str) -> Path:
    """The shipped file of a built-in task, by name (``BUILTIN`` or ``GENERATION``)."""
    if name not in BUILTIN + GENERATION:
        extra = " (retrieval is generated for a run's tokenizer: moelab.eval.builtin.write_retrieval)"
        raise UsageError(
            f"unknown built-in task {name!r}; built in: {', '.join(BUILTIN + GENERATION)}{extra if name == 'retrieval' else ''}"
        )
    return DATA / f"{name}.jsonl"


def task_path(spec: str | Path) -> Path:
    """A task named in a config or on a command line: a built-in's name (``BUILTIN``) or a file's path."""
    return builtin_task(str(spec)) if str(spec) in BUILTIN + GENERATION else Path(spec)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelab.eval.builtin", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(DATA), help="folder for the task files and tasks.json (default: shipped)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--n", type=int, default=N_EXAMPLES, help="examples per task")
    args = p.parse_args(argv)
    generate(args.out, args.seed, args.n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
