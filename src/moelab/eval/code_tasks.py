"""The three shipped multiple-choice tasks, cut from held-out code (moelab.eval.builtin holds the documents
and writes the files): a held-out file's lines and tokens (``Source``) and one maker per task.

Each task is a file in ``data/`` in the task format of ``moelab.eval.tasks``; each line also carries a
``"meta"`` object: where it came from, which ``load_task`` ignores.

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

In every task the evidence (the open bracket, the definition) lies within the last ``MAX_EVIDENCE``
characters of the context, so a model whose window cuts the context's start (``model_loglik`` keeps
its last ``seq_len`` tokens) still sees it. A context that would end in one space gives the space to
the choices instead (``f(`` + `` x``), as a byte-level BPE reads a word with the space before it.
"""

from __future__ import annotations

import builtins
import io
import keyword
import random
import re
import tokenize
from collections.abc import Sequence

MAX_CONTEXT = 512  # characters of context in the three short tasks
MAX_EVIDENCE = 320  # the open bracket or the definition lies within the context's last this many characters
MIN_CONTEXT = 160  # a shorter context (a file's first lines) is not asked
MIN_LINE = 8  # next_line: the real line and the distractors are at least this long once stripped
CLOSE = {"(": ")", "[": "]", "{": "}"}
BRACKET_CHOICES = (")", "]", "}")
_SKIP_NAMES = frozenset(dir(builtins)) | {"self", "cls", "__name__", "__main__", "__file__"}


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


def place(answer: str, others: Sequence[str], pos: int) -> list[str]:
    """The choices: ``others`` with ``answer`` inserted at ``pos``."""
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
                "choices": place(src.lines[i], others, pos),
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
        context, choices = _space_to_choices(context, place(name, others, pos))
        out.append(
            {
                "context": context,
                "choices": choices,
                "answer": pos,
                "meta": {"domain": src.domain, "doc": src.doc_id, "offset": off, "kind": kind},
            }
        )
    return out


# ---------------------------------------------------------------- the tasks by name

DESCRIPTIONS = {
    "next_line": "which of four lines really follows a held-out code context (distractors: lines of other "
    "held-out files with the same indentation)",
    "brackets": "which closing bracket, ) ] or }, closes the innermost bracket still open where the code is cut",
    "defined_name": "which of four names, used where the code is cut, was defined earlier in the context "
    "(def, class or name = ...); distractors are defined in other held-out files and occur nowhere in this one",
}
MAKERS = {"next_line": make_next_line, "brackets": make_brackets, "defined_name": make_defined_name}
