"""The built-in tasks (moelab.eval.builtin, moelab.eval.code_tasks): the shipped files load and every
answer is right by a check of its own (the source file's text, a bracket matcher that scans characters,
a pattern for definitions); every source document is held out; regeneration gives the same bytes; the
retrieval generator puts its key where its metadata says, at the depth and length asked."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from moelab.data.sources import is_held_out, stdlib_root
from moelab.errors import UsageError
from moelab.eval import builtin as B
from moelab.eval import code_tasks as C
from moelab.eval.tasks import load_task


def manifest() -> dict:
    return json.loads((B.DATA / B.MANIFEST).read_text())


def rows(name: str, folder=B.DATA) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]


def same_stdlib(meta: dict, man: dict) -> bool:
    """Whether this machine's standard library holds the document the shipped files were made from."""
    path = stdlib_root() / meta["doc"]
    want = man["documents"].get(f"{meta['domain']}/{meta['doc']}")
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest()[:16] == want


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    """The tasks made twice from this machine's standard library, each from a fresh read of it."""
    dirs = []
    for k in range(2):
        B.heldout_documents.cache_clear()
        out = tmp_path_factory.mktemp(f"tasks{k}")
        B.generate(out, progress=False)
        dirs.append(out)
    return dirs


def folders(regenerated):
    return [B.DATA, regenerated[0]]


def test_shipped_files_load_and_state_their_chance(regenerated):
    man = manifest()
    assert set(B.BUILTIN) <= set(man["tasks"]) and man["tasks"]["retrieval"]["chance"] == 0.25
    for name in B.BUILTIN:
        path = B.builtin_task(name)
        exs = load_task(path)
        entry = man["tasks"][name]
        assert len(exs) == entry["n_examples"] == len(rows(name)) >= 200
        assert entry["chance"] == pytest.approx(sum(1 / len(e.choices) for e in exs) / len(exs))
        counts = [sum(e.answer == j for e in exs) for j in range(entry["choices"])]
        assert entry["majority_rate"] == max(counts) / len(exs) <= entry["chance"] + 0.05
        for key, pick in (("longest_choice_rate", max), ("shortest_choice_rate", min)):  # length gives little away
            by_length = [
                pick(range(len(e.choices)), key=lambda j: (len(e.choices[j]), -j if pick is max else j)) for e in exs
            ]
            assert entry[key] == pytest.approx(
                sum(b == e.answer for b, e in zip(by_length, exs, strict=True)) / len(exs)
            )
            assert entry[key] <= entry["chance"] + 0.06, (name, key)
    with pytest.raises(UsageError, match="write_retrieval"):
        B.builtin_task("retrieval")
    with pytest.raises(UsageError, match="next_line, brackets, defined_name"):
        B.builtin_task("nope")
    assert B.task_path("brackets") == B.DATA / "brackets.jsonl" and str(B.task_path("my/task.jsonl")) == "my/task.jsonl"


def test_every_source_document_is_held_out(regenerated):
    man = manifest()
    f = man["held_out_fraction"]
    assert f == B.default_fraction() == 0.02
    for name in B.BUILTIN:
        for folder in folders(regenerated):
            for r in rows(name, folder):
                assert is_held_out(r["meta"]["domain"], r["meta"]["doc"], f), r["meta"]
                assert f"{r['meta']['domain']}/{r['meta']['doc']}" in man["documents"]
    for key in man["documents"]:
        domain, doc = key.split("/", 1)
        assert is_held_out(domain, doc, f)


def test_next_line_answer_follows_its_context_in_the_source_file(regenerated):
    man, checked = manifest(), 0
    for folder in folders(regenerated):
        for r in rows("next_line", folder):
            answer = r["choices"][r["answer"]]
            indent = answer[: len(answer) - len(answer.lstrip())]
            assert r["context"].endswith("\n") and len(r["context"]) <= C.MAX_CONTEXT
            for j, c in enumerate(r["choices"]):
                assert c[: len(c) - len(c.lstrip())] == indent and len(c.strip()) >= 8  # indentation gives nothing away
                assert j == r["answer"] or c.strip() != answer.strip()
            if folder == B.DATA and not same_stdlib(r["meta"], man):
                continue  # another Python's standard library: its files differ
            text = (stdlib_root() / r["meta"]["doc"]).read_text(encoding="utf-8")
            lines = text.split("\n")
            line = r["meta"]["line"]
            assert lines[line - 1] == answer
            assert "\n".join(lines[: line - 1]).endswith(r["context"][:-1])
            checked += 1
    assert checked >= 240


def innermost_open(code: str) -> tuple[str, int] | None:
    """The innermost bracket left open at the end of ``code`` and its offset, by a scan of its
    characters that skips strings (quoted, triple-quoted, with escapes) and comments."""
    stack, i, n = [], 0, len(code)
    while i < n:
        c = code[i]
        if c == "#":
            i = code.find("\n", i)
            i = n if i < 0 else i
        elif c in "'\"":
            quote = code[i : i + 3] if code[i : i + 3] in ('"""', "'''") else c
            j = i + len(quote)
            while j < n and code[j : j + len(quote)] != quote:
                j += 2 if code[j] == "\\" else 1
            i = j + len(quote)
        else:
            if c in "([{":
                stack.append((c, i))
            elif c in ")]}" and stack:
                stack.pop()
            i += 1
    return stack[-1] if stack else None


def test_brackets_answer_matches_a_naive_matcher(regenerated):
    for folder in folders(regenerated):
        for r in rows("brackets", folder):
            assert [c.strip() for c in r["choices"]] == [")", "]", "}"]
            found = innermost_open(r["context"])
            assert found is not None, r["meta"]
            opener, at = found
            assert {"(": ")", "[": "]", "{": "}"}[opener] == r["choices"][r["answer"]].strip(), r["meta"]
            assert len(r["context"]) - at <= C.MAX_EVIDENCE and len(r["context"]) <= C.MAX_CONTEXT


def test_defined_name_is_defined_in_the_context_and_the_others_nowhere(regenerated):
    for folder in folders(regenerated):
        for r in rows("defined_name", folder):
            ctx, names = r["context"], [c.strip() for c in r["choices"]]
            name = names[r["answer"]]
            defined = rf"(?:\b(?:def|class)\s+{name}\b)|(?:^[ \t]*{name}\s*=(?!=))"
            at = [m.start() for m in re.finditer(defined, ctx, re.MULTILINE)]
            assert at and at[-1] >= len(ctx) - C.MAX_EVIDENCE, (name, r["meta"])  # within the model's reach
            assert len(ctx) <= C.MAX_CONTEXT
            for j, other in enumerate(names):
                if j != r["answer"]:
                    assert not re.search(rf"\b{other}\b", ctx), (other, r["meta"])
                    assert abs(len(other) - len(name)) <= 4


def test_regeneration_gives_the_same_bytes(regenerated):
    a, b = regenerated
    files = sorted(p.name for p in a.iterdir() if not p.name.startswith("doctests."))  # moelab.eval.doctest_tasks
    assert (
        files
        == sorted(p.name for p in b.iterdir() if not p.name.startswith("doctests."))
        == sorted([*(f"{n}.jsonl" for n in B.BUILTIN), B.MANIFEST])
    )
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    here = json.loads((a / B.MANIFEST).read_text())["documents"]
    if here != manifest()["documents"]:
        pytest.skip("this machine's standard library differs from the one the shipped tasks came from")
    for f in files:
        assert (a / f).read_bytes() == (B.DATA / f).read_bytes(), f"{f}: the shipped file is stale; regenerate it"


# ---------------------------------------------------------------- retrieval


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def parts(ex: dict) -> tuple[str, str, str, str]:
    """(filler before the key, the key line, filler after it, the question) of a retrieval context."""
    ctx, m = ex["context"], ex["meta"]
    key = m["key_line"] + "\n"
    q = ctx.rindex("\nassert ") + 1 if "\nassert " in ctx else ctx.index("assert ")
    return ctx[: m["key_offset"]], ctx[m["key_offset"] : m["key_offset"] + len(key)], ctx[m["key_offset"] + len(key) : q], ctx[q:]  # fmt: skip


def check_retrieval(ex: dict, length: int, depth: float, count) -> None:
    ctx, m = ex["context"], ex["meta"]
    before, key, after, question = parts(ex)
    assert key == m["key_line"] + "\n" and re.fullmatch(r"secret_[a-z]+ = \d{5}\n", key)
    word, number = key[: key.index(" ")], key.split("= ")[1].strip()
    assert ctx.count(word) == 2 and ctx.count(number) == 1  # planted once, asked once
    assert question == f"assert {word} =="
    assert before == "" or before.endswith("\n")
    assert ex["choices"][ex["answer"]] == f" {number}"
    assert all(c.strip() not in ctx for j, c in enumerate(ex["choices"]) if j != ex["answer"])
    assert m["depth"] == depth and m["length"] == length and m["context_chars"] == len(ctx)
    # the length: at most the target, short of it by less than one filler line
    longest = max(count(line + "\n") for line in (before + after).split("\n"))
    assert length - longest <= count(ctx) <= length
    # the depth: the share of the filler before the key, at the line boundary nearest the one asked
    nb, na = count(before), count(after)
    assert abs(nb - depth * (nb + na)) <= longest / 2
    assert m["actual_depth"] == pytest.approx(nb / (nb + na))


FILLER = [
    "\n".join(f"value_{d}_{i} = compute({i}, {d})" for i in range(400)) for d in range(3)
]  # short lines: a fine grid of depths


@pytest.mark.parametrize("length", [256, 1024, 2048])
def test_retrieval_key_is_where_the_metadata_says_in_tokens(length):
    depths = (0.0, 0.1, 0.5, 0.9, 1.0)
    exs = B.retrieval_examples(4, length, depths, seed=3, filler_source=FILLER, encode=byte_tokens)
    assert len(exs) == 4 * len(depths)
    for ex in exs:
        check_retrieval(ex, length, ex["meta"]["depth"], lambda s: len(byte_tokens(s)))
        assert ex["meta"]["unit"] == "tokens" and ex["meta"]["context_tokens"] == len(byte_tokens(ex["context"]))
        if length >= 1024:  # lines of ~30 bytes: a fine grid
            assert abs(ex["meta"]["actual_depth"] - ex["meta"]["depth"]) <= 0.02


def test_retrieval_from_held_out_code_in_characters_and_tokens():
    docs = B.task_documents(B.CODE_DOMAINS)
    assert all(is_held_out(d, i, 0.02) for d, i, _ in docs)
    held_lines = {ln for _, _, t in docs for ln in t.split("\n")}
    for encode in (None, byte_tokens):
        exs = B.retrieval_examples(3, 1500, (0.1, 0.9), seed=1, filler_source="code", encode=encode)
        for ex in exs:
            check_retrieval(ex, 1500, ex["meta"]["depth"], len if encode is None else lambda s: len(byte_tokens(s)))
            before, _, after, _ = parts(ex)
            assert all(ln in held_lines for ln in (before + after).split("\n")[:-1])  # held-out code only
    assert B.retrieval_examples(2, 800, (0.5,), filler_source="prose")[0]["meta"]["unit"] == "chars"


def test_retrieval_holds_the_length_where_joins_merge_differently():
    """A tokenizer whose count of two texts joined is more than the sum (here: a newline before the key
    costs 8 tokens more) still gets a context within its length."""

    def merging(text: str) -> list[int]:
        return byte_tokens(text) + [0] * (8 * text.count("\nsecret_"))

    filler = ["\n".join(f"item_{i} = {i}" for i in range(300))]
    for depth in (0.0, 0.3, 0.7):
        for ex in B.retrieval_examples(4, 512, (depth,), seed=5, filler_source=filler, encode=merging):
            assert 512 - 40 <= len(merging(ex["context"])) <= 512 == ex["meta"]["length"]
            assert ex["meta"]["context_tokens"] == len(merging(ex["context"]))


def test_retrieval_is_deterministic_and_loads_as_a_task(tmp_path):
    a = B.retrieval_examples(3, 600, (0.5,), seed=7, filler_source=FILLER)
    assert a == B.retrieval_examples(3, 600, (0.5,), seed=7, filler_source=FILLER)
    assert a != B.retrieval_examples(3, 600, (0.5,), seed=8, filler_source=FILLER)
    paths = B.write_retrieval(tmp_path, byte_tokens, lengths=(300, 600), depths=(0.1, 0.9), n=2, filler_source=FILLER)
    assert [p.name for p in paths] == [f"retrieval_L{n}_d{d}.jsonl" for n in (300, 600) for d in (0.1, 0.9)]
    for p in paths:
        exs = load_task(p)
        assert len(exs) == 2 and all(len(e.choices) == 4 for e in exs)
    with pytest.raises(UsageError, match="too short"):
        B.retrieval_examples(1, 10, (0.5,), filler_source=FILLER)
