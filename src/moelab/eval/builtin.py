"""Built-in task evaluations, made offline from held-out text of the demo corpus (the standard library).

Every example is cut from documents that the data pipeline holds out of training: the ``stdlib``
source's documents (``moelab.data.sources``: same domains, same document ids, documents longer than
``MAX_PIECE_CHARS`` cut into the same pieces, empty ones skipped, as the token store does) for which
``is_held_out(domain, doc_id, fraction)`` is true at the default ``data.held_out_fraction`` (0.02). The
split is a hash of the domain and the id, so a run holds these documents out whatever its Python
version, as long as its fraction is at least 0.02. The shipped files come from the Python named in
``data/tasks.json`` (with a hash of every source document); ``python -m moelab.eval.builtin``
regenerates them, the same bytes for the same seed and the same standard library.

The multiple-choice tasks (files in ``data/``, the task format of ``moelab.eval.tasks``; each line also
carries a ``"meta"`` object: where it came from, which ``load_task`` ignores):

- ``next_line`` (chance 25%): a code context (whole lines, at most ``MAX_CONTEXT`` characters, ending
  at a newline) and four candidate next lines: the real one and three lines of other held-out files
  with the same indentation (so indentation gives nothing away) and lengths in a window about its own
  (placed at random, so the longest or shortest choice is right about a quarter of the time), none of
  them a line of the answer's file, none inside a multi-line string, each at least 8 characters once
  stripped. The answer's position is balanced (a quarter each).
- ``brackets`` (chance 1/3): code cut just before a closing bracket; choices ``)``, ``]``, ``}``; the
  answer closes the innermost bracket still open (found by ``tokenize``, so brackets in strings and
  comments do not count; an empty pair such as ``()`` is never asked). The three answers are
  balanced, so always guessing ``)`` scores the majority rate the manifest states (1/3 here).
- ``defined_name`` (chance 25%): code cut where a name is used that the context defined earlier (by
  ``def``, ``class`` or an assignment ``name = ...`` at the start of a statement); choices: that name
  and three names defined the same way in other held-out files, of its length where there are enough
  (else the nearest lengths), that occur nowhere in the answer's file. The answer's position is balanced.

Held-out files that dozens of training files repeat almost line for line (the character-map codecs
written by gencodec.py) are left out (``near_copy``): a task on them would measure recall of the
training files.

In every task the evidence (the open bracket, the definition) lies within the last ``MAX_EVIDENCE``
characters of the context, so a model whose window cuts the context's start (``model_loglik`` keeps
its last ``seq_len`` tokens) still sees it. A context that would end in one space gives the space to
the choices instead (``f(`` + `` x``), as a byte-level BPE reads a word with the space before it.

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
import builtins
import functools
import hashlib
import io
import json
import keyword
import random
import re
import sys
import tokenize
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from moelab.errors import UsageError

DATA = Path(__file__).parent / "data"
MANIFEST = "tasks.json"
BUILTIN = ("next_line", "brackets", "defined_name")
CODE_DOMAINS = ("stdlib-code", "stdlib-tests")
PROSE_DOMAINS = ("stdlib-docs",)
SEED = 0
N_EXAMPLES = 240  # per multiple-choice task: divisible by 3 and 4, so answers balance exactly
MAX_CONTEXT = 512  # characters of context in the three short tasks
MAX_EVIDENCE = 320  # the open bracket or the definition lies within the context's last this many characters
MIN_CONTEXT = 160  # a shorter context (a file's first lines) is not asked
MIN_LINE = 8  # next_line: the real line and the distractors are at least this long once stripped
CLOSE = {"(": ")", "[": "]", "{": "}"}
BRACKET_CHOICES = (")", "]", "}")
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
_SKIP_NAMES = frozenset(dir(builtins)) | {"self", "cls", "__name__", "__main__", "__file__"}


# ---------------------------------------------------------------- the held-out documents


def default_fraction() -> float:
    from moelab.config import DataConfig

    return DataConfig().held_out_fraction


@functools.lru_cache(maxsize=8)
def heldout_documents(domains: tuple[str, ...] = CODE_DOMAINS, fraction: float | None = None) -> tuple:
    """(domain, doc_id, text) of the ``stdlib`` source's held-out documents in the given domains, in
    the pipeline's order: its documents (``iter_documents``), empty ones skipped, cut into the store's
    pieces, kept where ``is_held_out`` says so."""
    from moelab.data import sources as S

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


# ---------------------------------------------------------------- a file's lines and tokens


class Source:
    """One held-out document: its lines, their offsets, its tokens, which lines start inside a string."""

    def __init__(self, domain: str, doc_id: str, text: str):
        self.domain, self.doc_id, self.text = domain, doc_id, text
        self.lines = text.split("\n")  # the last is what follows the final newline ("" usually)
        self.starts = [0]
        for line in self.lines[:-1]:
            self.starts.append(self.starts[-1] + len(line) + 1)
        self.tokens: list[tokenize.TokenInfo] = []
        self.ok = False
        try:
            self.tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
            self.ok = True
        except (tokenize.TokenError, SyntaxError):
            pass
        self.in_string = set()  # 0-based lines that start inside a multi-line string
        fstring = getattr(tokenize, "FSTRING_START", None)
        depth, open_row = 0, 0
        for t in self.tokens:
            if fstring is not None and t.type == fstring:  # Python 3.12+: an f-string is several tokens
                depth += 1
                open_row = t.start[0] if depth == 1 else open_row
            elif fstring is not None and t.type == tokenize.FSTRING_END:
                depth -= 1
                if depth == 0:
                    self.in_string.update(range(open_row, t.end[0]))
            elif t.type == tokenize.STRING and t.end[0] > t.start[0]:
                self.in_string.update(range(t.start[0], t.end[0]))  # rows start[0]+1..end[0], 0-based

    def offset(self, pos: tuple[int, int]) -> int:
        return self.starts[pos[0] - 1] + pos[1]

    def code_tokens(self) -> list[tuple[tokenize.TokenInfo, int]]:
        """(token, character offset) of the tokens outside strings (on Python 3.12+, where an f-string
        is several tokens, outside f-strings too)."""
        out, depth = [], 0
        fstring = getattr(tokenize, "FSTRING_START", None)
        for t in self.tokens:
            if fstring is not None and t.type == fstring:
                depth += 1
            elif fstring is not None and t.type == tokenize.FSTRING_END:
                depth -= 1
            elif depth == 0 and t.type not in (tokenize.ENDMARKER,):
                out.append((t, self.offset(t.start)))
        return out

    def context_start(self, end: int, evidence: int) -> int | None:
        """The earliest line start at most MAX_CONTEXT characters before ``end``, not inside a string,
        at or before ``evidence``; None when there is none."""
        for row, start in enumerate(self.starts):
            if start > evidence or start > end:
                return None
            if end - start <= MAX_CONTEXT and row not in self.in_string:
                return start
        return None


def _space_to_choices(context: str, choices: list[str]) -> tuple[str, list[str]]:
    """A context that ends in one space after a non-space gives it to the choices."""
    if context.endswith(" ") and len(context) > 1 and not context[-2].isspace():
        return context[:-1], [" " + c for c in choices]
    return context, choices


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _round_robin(per_file: dict[str, list], n: int, rng: random.Random) -> list:
    """Up to ``n`` items taken a file at a time (files in a shuffled order, each file's items shuffled),
    so no one large file fills the task."""
    queues = []
    for key in sorted(per_file):
        items = list(per_file[key])
        rng.shuffle(items)
        queues.append(items)
    rng.shuffle(queues)
    out: list = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop())
    return out


def _place(answer: str, others: Sequence[str], pos: int) -> list[str]:
    choices = list(others)
    choices.insert(pos, answer)
    return choices


def _positions(n: int, k: int, rng: random.Random) -> list[int]:
    """The answer's position in each example: every position equally often, in a shuffled order."""
    pos = [i % k for i in range(n)]
    rng.shuffle(pos)
    return pos


# ---------------------------------------------------------------- next_line


def make_next_line(sources: Sequence[Source], n: int, rng: random.Random) -> list[dict]:
    def usable(src: Source, i: int) -> bool:
        line = src.lines[i]
        return (
            i < len(src.lines) - 1  # a whole line, ended by a newline
            and len(line.strip()) >= MIN_LINE
            and i not in src.in_string
            and "\r" not in line
            and "\x0c" not in line
        )

    pool: dict[str, list[tuple[str, str]]] = {}  # indentation -> (doc id, line)
    cands: dict[str, list[tuple[Source, int]]] = {}
    for src in sources:
        if not src.ok:
            continue
        for i, line in enumerate(src.lines):
            if not usable(src, i):
                continue
            indent = line[: len(line) - len(line.lstrip())]
            pool.setdefault(indent, []).append((src.doc_id, line))
            if i > 0:
                cands.setdefault(src.doc_id, []).append((src, i))
    chosen = []
    file_lines: dict[str, set[str]] = {}  # a distractor is no line of the answer's file
    for src, i in _round_robin(cands, 4 * n, rng):
        end = src.starts[i]
        start = src.context_start(end, end)
        if start is None or end - start < MIN_CONTEXT:
            continue
        line = src.lines[i]
        indent = line[: len(line) - len(line.lstrip())]
        others, seen = [], {line.strip()}
        mine = file_lines.setdefault(src.doc_id, {ln.strip() for ln in src.lines})
        # lengths in a window of half its length that holds it at a random place, so the real line is
        # as likely to be the longest of the four as the shortest: length gives little away
        width = max(8, len(line) // 2)
        lo = len(line) - rng.random() * width
        for doc_id, other in rng.sample(pool[indent], min(len(pool[indent]), 256)):
            stripped = other.strip()
            if (
                doc_id != src.doc_id
                and stripped not in seen
                and stripped not in mine
                and lo <= len(other) <= lo + width
            ):
                others.append(other)
                seen.add(stripped)
            if len(others) == 3:
                break
        if len(others) < 3:
            continue
        chosen.append((src, i, start, others))
        if len(chosen) == n:
            break
    out = []
    for (src, i, start, others), pos in zip(chosen, _positions(len(chosen), 4, rng), strict=True):
        out.append(
            {
                "context": src.text[start : src.starts[i]],
                "choices": _place(src.lines[i], others, pos),
                "answer": pos,
                "meta": {"domain": src.domain, "doc": src.doc_id, "line": i + 1},
            }
        )
    return out


# ---------------------------------------------------------------- brackets


def open_brackets(src: Source) -> list[tuple[int, int, str]]:
    """(open offset, close offset, closing character) of every bracket pair in code (not in strings
    or comments), by the tokenizer."""
    stack, pairs = [], []
    for t, off in src.code_tokens():
        if t.type != tokenize.OP:
            continue
        if t.string in CLOSE:
            stack.append((t.string, off))
        elif t.string in BRACKET_CHOICES and stack:
            opener, at = stack.pop()
            pairs.append((at, off, CLOSE[opener]))
    return pairs


def make_brackets(sources: Sequence[Source], n: int, rng: random.Random) -> list[dict]:
    by_close: dict[str, dict[str, list]] = {c: {} for c in BRACKET_CHOICES}
    for src in sources:
        if not src.ok:
            continue
        for at, close, char in open_brackets(src):
            if not src.text[at + 1 : close].strip() or close - at > MAX_EVIDENCE:
                continue  # an empty pair, or an opener too far back
            by_close[char].setdefault(src.doc_id, []).append((src, at, close, char))
    picked: dict[str, list] = {}
    for char in BRACKET_CHOICES:
        picked[char] = []
        for src, at, close, c in _round_robin(by_close[char], 4 * n, rng):
            start = src.context_start(close, at)
            if start is not None and close - start >= MIN_CONTEXT:
                picked[char].append((src, at, close, c, start))
    # a third each; a class short of its third leaves its place to the others (the manifest states the
    # majority rate)
    share = {c: min(n // 3, len(picked[c])) for c in BRACKET_CHOICES}
    for c in sorted(BRACKET_CHOICES, key=lambda c: -len(picked[c])):
        share[c] += min(n - sum(share.values()), len(picked[c]) - share[c])
    rows = [p for c in BRACKET_CHOICES for p in picked[c][: share[c]]]
    rng.shuffle(rows)
    out = []
    for src, at, close, char, start in rows:
        context, choices = _space_to_choices(src.text[start:close], list(BRACKET_CHOICES))
        out.append(
            {
                "context": context,
                "choices": choices,
                "answer": BRACKET_CHOICES.index(char),
                "meta": {"domain": src.domain, "doc": src.doc_id, "offset": close, "open_offset": at},
            }
        )
    return out


# ---------------------------------------------------------------- defined_name


def definitions(src: Source) -> list[tuple[str, str, int, int]]:
    """(name, kind, offset of the name, offset of its line) of every ``def``/``class`` name and every
    ``name = ...`` that starts a statement."""
    toks = src.code_tokens()
    out = []
    statement_start = True
    for k, (t, off) in enumerate(toks):
        nxt = toks[k + 1][0] if k + 1 < len(toks) else None
        if t.type == tokenize.NAME and t.string in ("def", "class") and nxt is not None and nxt.type == tokenize.NAME:
            out.append((nxt.string, t.string, toks[k + 1][1], src.starts[t.start[0] - 1]))
        elif statement_start and t.type == tokenize.NAME and nxt is not None and nxt.type == tokenize.OP:
            if nxt.string == "=" and not keyword.iskeyword(t.string):
                out.append((t.string, "assign", off, src.starts[t.start[0] - 1]))
        if t.type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT):
            statement_start = True
        elif not (t.type == tokenize.OP and t.string == ";"):
            statement_start = False
        else:
            statement_start = True
    return out


def _nameable(name: str) -> bool:
    return (
        len(name) >= 4 and name not in _SKIP_NAMES and not keyword.iskeyword(name) and not keyword.issoftkeyword(name)
    )


def _identifiers(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def make_defined_name(sources: Sequence[Source], n: int, rng: random.Random) -> list[dict]:
    names: dict[tuple[str, int], dict[str, set[str]]] = {}  # (kind, length) -> name -> doc ids defining it
    cands: dict[str, list] = {}
    idents: dict[str, set[str]] = {}
    for src in sources:
        if not src.ok:
            continue
        idents[src.doc_id] = _identifiers(src.text)
        defs = [d for d in definitions(src) if _nameable(d[0])]
        by_name: dict[str, list[tuple[int, str, int]]] = {}
        for name, kind, off, line_start in defs:
            names.setdefault((kind, len(name)), {}).setdefault(name, set()).add(src.doc_id)
            by_name.setdefault(name, []).append((off, kind, line_start))
        def_offsets = {d[2] for d in defs}
        toks = src.code_tokens()
        for k, (t, off) in enumerate(toks):
            if t.type != tokenize.NAME or t.string not in by_name or off in def_offsets:
                continue
            prev = toks[k - 1][0] if k else None
            nxt = toks[k + 1][0] if k + 1 < len(toks) else None
            if prev is not None and (
                (prev.type == tokenize.OP and prev.string == ".")
                or prev.string in ("def", "class", "import", "from", "as", "global", "nonlocal")
            ):
                continue
            if nxt is not None and nxt.type == tokenize.OP and nxt.string == "=":
                continue
            before = [d for d in by_name[t.string] if d[0] < off]  # its latest definition before the use
            if before and off - before[-1][2] <= MAX_EVIDENCE:
                cands.setdefault(src.doc_id, []).append((src, off, t.string, before[-1][1], before[-1][2]))
    kinds = sorted({kind for kind, _ in names})
    rows = []
    for src, off, name, kind, line_start in _round_robin(cands, 4 * n, rng):
        start = src.context_start(off, line_start)
        if start is None or off - start < MIN_CONTEXT:
            continue
        others: list[str] = []
        # names defined the same way in another held-out file, as long as this one (else give or take 1,
        # 2, then 4 characters; then defined any way), never occurring in this file
        for tol, want in ((0, [kind]), (1, [kind]), (2, [kind]), (4, [kind]), (4, kinds)):
            pool = sorted(
                {
                    other
                    for kk in want
                    for length in range(len(name) - tol, len(name) + tol + 1)
                    for other, docs in names.get((kk, length), {}).items()
                    if other not in idents[src.doc_id] and docs - {src.doc_id}
                }
            )
            if len(pool) >= 3:
                others = rng.sample(pool, 3)
                break
        if not others:
            continue
        rows.append((src, off, name, kind, src.text[start:off], others))
        if len(rows) == n:
            break
    out = []
    for (src, off, name, kind, context, others), pos in zip(rows, _positions(len(rows), 4, rng), strict=True):
        context, choices = _space_to_choices(context, _place(name, others, pos))
        out.append(
            {
                "context": context,
                "choices": choices,
                "answer": pos,
                "meta": {"domain": src.domain, "doc": src.doc_id, "offset": off, "kind": kind},
            }
        )
    return out


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
    choices = [f" {x}" for x in _place(number, others, pos)]
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


DESCRIPTIONS = {
    "next_line": "which of four lines really follows a held-out code context (distractors: lines of other "
    "held-out files with the same indentation)",
    "brackets": "which closing bracket, ) ] or }, closes the innermost bracket still open where the code is cut",
    "defined_name": "which of four names, used where the code is cut, was defined earlier in the context "
    "(def, class or name = ...); distractors are defined in other held-out files and occur nowhere in this one",
}
MAKERS = {"next_line": make_next_line, "brackets": make_brackets, "defined_name": make_defined_name}


def generate(out: str | Path = DATA, seed: int = SEED, n: int = N_EXAMPLES, progress: bool = True) -> dict:
    """Write the three tasks and their manifest (``tasks.json``) into ``out``; return the manifest."""
    from moelab.progress import say

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
    """The shipped file of a built-in task, by name (``BUILTIN``)."""
    if name not in BUILTIN:
        extra = " (retrieval is generated for a run's tokenizer: moelab.eval.builtin.write_retrieval)"
        raise UsageError(
            f"unknown built-in task {name!r}; built in: {', '.join(BUILTIN)}{extra if name == 'retrieval' else ''}"
        )
    return DATA / f"{name}.jsonl"


def task_path(spec: str | Path) -> Path:
    """A task named in a config or on a command line: a built-in's name (``BUILTIN``) or a file's path."""
    return builtin_task(str(spec)) if str(spec) in BUILTIN else Path(spec)


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
