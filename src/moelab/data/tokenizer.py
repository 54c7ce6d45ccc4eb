"""The tokenizer of a token store: one trained here (the default), or one given by ``data.tokenizer``.

``data.tokenizer`` is a ``tokenizer.json``, or a folder holding one, optionally with the
``tokenizer_config.json`` and ``special_tokens_map.json`` that transformers' ``save_pretrained``
writes next to it (their tokens may be plain strings or ``{"content": ...}`` objects). A file given
alone is read alone; point at the folder for its configuration to count.

The special tokens come from the tokenizer's own configuration, by this rule:

- **EOS** (the document separator, the store's ``eot``): ``eos_token`` of tokenizer_config.json,
  else ``eos_token`` of special_tokens_map.json, else the first of ``END_OF_TEXT`` that the tokenizer
  holds as a special token (``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``, ...), else
  ``<|endoftext|>`` is added as a new special token (``Tok.added_eot``, and ``Tok.origin`` says so).
  A configuration naming an ``eos_token`` the tokenizer does not hold is an error.
- **BOS**: ``bos_token`` of tokenizer_config.json, else of special_tokens_map.json, else the special
  token the tokenizer's own post-processor puts first (Llama-3's TemplateProcessing puts
  ``<|begin_of_text|>`` there), else none. A configured ``bos_token`` it does not hold is an error.
- **Whether BOS starts each document**: ``add_bos_token`` of tokenizer_config.json when present,
  else whether the post-processor puts a special token first.
- **PAD**: ``pad_token`` of the configurations (tokenizer_config.json first), else none; one the
  tokenizer does not hold is left out (nothing here pads), and ``origin`` says so.

Documents are always encoded without the post-processor's special tokens (``add_special_tokens=False``)
and get ``[bos] + ids + [eos]`` (bos when ``add_bos``) from here, so nothing is doubled or left out,
and a tokenizer that has its own end-of-text token is used as it is, with no token added.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from moelab.errors import DataError

EOT = "<|endoftext|>"  # the end-of-text token of a tokenizer trained here, and the one added when there is none
END_OF_TEXT = (  # well-known end-of-text tokens, in the order they are looked for
    "<|endoftext|>",  # GPT-2, GPT-NeoX, Pythia, StarCoder, Qwen
    "<|end_of_text|>",  # Llama 3
    "</s>",  # Llama 2, Mistral, T5, OPT
    "<eos>",  # Gemma
    "<|end▁of▁sentence|>",  # DeepSeek
    "[EOS]",
    "<|eos|>",
)
TOKENIZER_JSON = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # in the order they are asked
SAVED = "tokenizer_moelab.json"  # a store's record of which ids are its eos, bos and pad
RULE_VERSION = 1  # in the fingerprint: a change to the rule above changes the stores' keys
_PROBE_TEXTS = ("a", "Hello world", "0")  # to see what the post-processor adds around a text
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
K = TypeVar("K")
_METASPACE = "\u2581"  # SentencePiece's ▁, which stands for a space


@dataclass
class Tok:
    tokenizer: object = field(repr=False)  # tokenizers.Tokenizer
    eos: int  # ends each document: the token store's eot
    bos: int | None
    pad: int | None
    add_bos: bool  # bos starts each document
    added_eot: bool  # the tokenizer had no end-of-text token and EOT was added
    origin: str  # where each came from, in one phrase (for a log line)

    @property
    def vocab_size(self) -> int:
        """Ids run below this (the tokenizer's size, or past its largest id if its ids have holes)."""
        return _vocab_size(self.tokenizer)


def _vocab_size(tokenizer) -> int:
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(n, max(vocab.values()) + 1) if vocab else n


# -- finding the files ------------------------------------------------------------------------------


def _files(spec) -> tuple[Path, list[Path]]:
    """The tokenizer.json ``spec`` names and the configuration files beside it that count."""
    path = Path(spec).expanduser()
    if path.is_dir():
        tj = path / TOKENIZER_JSON
        if not tj.is_file():
            raise DataError(
                f"{path}: no {TOKENIZER_JSON} in this folder (data.tokenizer takes a tokenizer.json or a folder "
                "holding one, as transformers' save_pretrained writes it)"
            )
        return tj, [path / n for n in CONFIG_FILES if (path / n).is_file()]
    if path.is_file():
        return path, []
    raise DataError(f"{spec}: no such tokenizer file or folder (data.tokenizer)")


def fingerprint(spec) -> str:
    """sha256 over the files that decide the tokenizer (its tokenizer.json and the configuration
    files that count) and the version of the rule that reads them: the token store's cache key."""
    tj, configs = _files(spec)
    h = hashlib.sha256(f"moelab-tokenizer-rule-{RULE_VERSION}\0".encode())
    for f in [tj, *configs]:
        data = f.read_bytes()
        h.update(f"{f.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _read_tokenizer(tj: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tj))
    except Exception as exc:  # the Rust side raises plain Exceptions
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{tj}: not a readable tokenizer.json ({first})") from None


def _read_config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{path}: not readable JSON ({first})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


def _token_name(path: Path, cfg: dict, key: str) -> str | None:
    """A token the configuration names under ``key``: a string or ``{"content": ...}``; None when absent."""
    value = cfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise DataError(f'{path}: {key} is {value!r}; a token is a string or an object with a "content" string')
    return value


def _configured(tokenizer, tj: Path, configs: list[tuple[Path, dict]], key: str, required: bool):
    """(id, phrase) of the token that the first configuration naming ``key`` names; (None, None) when
    none names one; a named token the tokenizer does not hold is an error when ``required``."""
    for path, cfg in configs:
        name = _token_name(path, cfg, key)
        if name is None:
            continue
        i = tokenizer.token_to_id(name)
        if i is None:
            if required:
                raise DataError(
                    f"{path}: {key} {name!r} is not in the vocabulary of {tj}; name a token it holds, or remove {key}"
                )
            return None, f"{key.split('_')[0]} {name!r} named by {path.name} is not in the vocabulary, left out"
        return i, f"{key.split('_')[0]} {name!r} ({i}) from {path.name}"
    return None, None


def _template_first(tokenizer) -> int | None:
    """The special token the tokenizer's post-processor puts before a text, if it puts one."""
    for text in _PROBE_TEXTS:
        bare = tokenizer.encode(text, add_special_tokens=False)
        if not bare.ids:  # nothing to tell a token put before the text from one put after it
            continue
        full = tokenizer.encode(text, add_special_tokens=True)
        if full.ids and full.special_tokens_mask[0] == 1 and len(full.ids) > len(bare.ids):
            return full.ids[0]
        return None
    return None


def _special_ids(tokenizer) -> dict[str, int]:
    return {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


# -- loading, training, saving -------------------------------------------------------------------


def load(spec, vocab_size: int) -> Tok:
    """The tokenizer ``data.tokenizer`` names, its eos, bos and pad found by the rule above."""
    tj, config_paths = _files(spec)
    tokenizer = _read_tokenizer(tj)
    configs = [(p, _read_config(p)) for p in config_paths]
    said = []

    eos, phrase = _configured(tokenizer, tj, configs, "eos_token", required=True)
    added_eot = False
    if eos is None:
        specials = _special_ids(tokenizer)
        name = next((n for n in END_OF_TEXT if n in specials), None)
        if name is not None:
            eos, phrase = specials[name], f"eos {name!r} ({specials[name]}), a well-known end-of-text token it holds"
        else:
            tokenizer.add_special_tokens([EOT])
            eos, added_eot = tokenizer.token_to_id(EOT), True
            phrase = f"eos {EOT!r} ({eos}) added: the tokenizer names no end-of-text token and holds none"
    said.append(phrase)

    template = _template_first(tokenizer)
    bos, phrase = _configured(tokenizer, tj, configs, "bos_token", required=True)
    if bos is None and template is not None:
        bos, phrase = template, f"bos {tokenizer.id_to_token(template)!r} ({template}) from its post-processor"
    add_bos = template is not None
    why = "" if template is None or phrase.endswith("post-processor") else " (its post-processor puts a bos first)"
    config = next((c for p, c in configs if p.name == "tokenizer_config.json"), {})
    if "add_bos_token" in config:
        flag = config["add_bos_token"]
        if not isinstance(flag, bool):
            raise DataError(f"{tj.parent / 'tokenizer_config.json'}: add_bos_token is {flag!r}; write true or false")
        add_bos, why = flag, " (add_bos_token)"
        if add_bos and bos is None:
            raise DataError(
                f"{tj.parent / 'tokenizer_config.json'}: add_bos_token is true but no bos_token is named; "
                "name one or set add_bos_token to false"
            )
    if bos is None:
        said.append("no bos")
    else:
        said.append(f"{phrase}, " + (f"prepended to each document{why}" if add_bos else "not prepended"))

    pad, phrase = _configured(tokenizer, tj, configs, "pad_token", required=False)
    said.append(phrase or "no pad")

    n = _vocab_size(tokenizer)
    if n > vocab_size:
        more = f" (with the {EOT} added)" if added_eot else ""
        raise DataError(
            f"{tj}: {n} tokens{more}, more than model.vocab_size={vocab_size}; set model.vocab_size to {n} or more"
        )
    return Tok(tokenizer, eos, bos, pad, add_bos, added_eot, f"{tj}: " + "; ".join(said))


def train(texts, vocab_size: int, special: tuple[str, ...] = ()) -> Tok:
    """A byte-level BPE with ``EOT`` as token 0 and the ``special`` tokens after it (a chat template's
    markers, added once: each one token); every byte is in its alphabet, so nothing is unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, *special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    eos = tokenizer.token_to_id(EOT)
    extra = f"; special {', '.join(special)}" if special else ""
    return Tok(
        tokenizer, eos, None, None, False, False, f"byte-level BPE trained here: eos {EOT!r} ({eos}); no bos{extra}"
    )


def save(tok: Tok, folder) -> None:
    """tokenizer.json and tokenizer_moelab.json (which ids are eos, bos and pad) into ``folder``."""
    folder = Path(folder)
    tok.tokenizer.save(str(folder / TOKENIZER_JSON))
    meta = {
        "eos": tok.eos,
        "bos": tok.bos,
        "pad": tok.pad,
        "add_bos": tok.add_bos,
        "added_eot": tok.added_eot,
        "origin": tok.origin,
    }
    (folder / SAVED).write_text(json.dumps(meta, indent=1) + "\n")


def load_saved(folder) -> Tok:
    """A token store's own tokenizer, as ``save`` wrote it. A store from before tokenizer_moelab.json
    is read as those stores were made: ``EOT`` ends each document, no bos."""
    folder = Path(folder)
    tj = folder / TOKENIZER_JSON
    if not tj.is_file():
        raise DataError(f"{folder}: no {TOKENIZER_JSON} (a token store holds its tokenizer; build the store again)")
    tokenizer = _read_tokenizer(tj)
    meta_path = folder / SAVED
    if not meta_path.is_file():
        eos = tokenizer.token_to_id(EOT)
        if eos is None:
            raise DataError(f"{folder}: no {SAVED} and no {EOT} in {tj}; build the store again")
        return Tok(tokenizer, eos, None, None, False, False, f"{tj}: a store from before {SAVED}: eos {EOT!r} ({eos})")
    meta = _read_config(meta_path)
    try:
        tok = Tok(
            tokenizer,
            int(meta["eos"]),
            None if meta["bos"] is None else int(meta["bos"]),
            None if meta["pad"] is None else int(meta["pad"]),
            bool(meta["add_bos"]),
            bool(meta["added_eot"]),
            str(meta["origin"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(
            f"{meta_path}: not a tokenizer record ({type(exc).__name__}: {exc}); build the store again"
        ) from None
    n = tok.vocab_size
    if not 0 <= tok.eos < n or (tok.add_bos and (tok.bos is None or not 0 <= tok.bos < n)):
        raise DataError(f"{meta_path}: its eos or bos is not an id of {tj}; build the store again")
    return tok


# -- encoding -------------------------------------------------------------------------------------


def encode(tok: Tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Every document's ids, each as ``[bos] + ids + [eos]`` (bos when ``tok.add_bos``), concatenated
    into one uint32 array, and each document's token count (int64).

    One batched call to the tokenizer (threaded in Rust), then each document's list of ids copied
    into its slice of one array allocated once (as fast as ``np.fromiter`` over a chain of the lists,
    ``np.array`` of one flat list or ``np.concatenate`` of per-document arrays, and simpler)."""
    return flatten(tok, tok.tokenizer.encode_batch_fast(texts, add_special_tokens=False))


def encode_batches(tok: Tok, batches: Iterable[tuple[K, list[str]]]) -> Iterator[tuple[K, np.ndarray, np.ndarray]]:
    """``(key, *encode(tok, texts))`` for each ``(key, texts)`` of ``batches``, in order: the token
    store's hot loop. The tokenizer encodes the next batch in a worker thread (it lets go of the GIL)
    while this thread turns the last one into an array and the caller writes it and reads on, so the
    Python work per token is hidden behind the tokenizer's own."""
    from concurrent.futures import ThreadPoolExecutor

    def run(texts):
        return tok.tokenizer.encode_batch_fast(texts, add_special_tokens=False)

    with ThreadPoolExecutor(1, thread_name_prefix="moelab-encode") as pool:
        pending = None
        for key, texts in batches:
            submitted = (key, pool.submit(run, texts))
            if pending is not None:
                yield pending[0], *flatten(tok, pending[1].result())
            pending = submitted
        if pending is not None:
            yield pending[0], *flatten(tok, pending[1].result())


def flatten(tok: Tok, encodings) -> tuple[np.ndarray, np.ndarray]:
    ids = [e.ids for e in encodings]
    add_bos = bool(tok.add_bos)
    counts = np.fromiter(map(len, ids), np.int64, len(ids))
    counts += 1 + add_bos
    ends = np.cumsum(counts)
    out = np.empty(int(ends[-1]) if len(ends) else 0, np.uint32)
    out[ends - 1] = tok.eos
    if add_bos:
        out[ends - counts] = tok.bos
    starts = (ends - counts + add_bos).tolist()
    for doc, start in zip(ids, starts, strict=True):
        out[start : start + len(doc)] = doc
    return out, counts


# -- bytes per token -------------------------------------------------------------------------------


def _has_type(node, name: str) -> bool:
    """Whether a component of the tokenizer's JSON (a pre-tokenizer, a decoder) is or holds ``name``."""
    if isinstance(node, dict):
        return node.get("type") == name or any(_has_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, name) for v in node)
    return False


def _replacements(node) -> set[str]:
    """The characters that Metaspace components of the tokenizer's JSON use for a space."""
    found = set()
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and isinstance(node.get("replacement"), str):
            found.add(node["replacement"])
        for v in node.values():
            found |= _replacements(v)
    elif isinstance(node, list):
        for v in node:
            found |= _replacements(v)
    return found


def byte_lengths(tok: Tok) -> np.ndarray:
    """Bytes of text each id stands for (0 for special tokens), for bits per byte.

    A byte-level tokenizer's pieces hold one character per byte, so a piece's length is its bytes.
    Otherwise a piece is text: a byte-fallback piece ``<0xAB>`` is one byte, a SentencePiece ``▁``
    (or a Metaspace's own replacement) is the space it stands for, a WordPiece/BPE continuation
    prefix or end-of-word suffix is no text, and the rest counts its UTF-8 bytes. A tokenizer that
    prepends ``▁`` to each text (Llama 2, Metaspace prepend_scheme first/always) therefore counts one
    byte more per document than the document holds. A non-special added token counts its content."""
    from tokenizers import pre_tokenizers

    tokenizer = tok.tokenizer
    out = np.zeros(tok.vocab_size, np.int32)
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    byte_level = _has_type(spec.get("pre_tokenizer"), "ByteLevel") or _has_type(spec.get("decoder"), "ByteLevel")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_fallback = bool(model.get("byte_fallback"))
    prefix = model.get("continuing_subword_prefix") or ""
    suffix = model.get("end_of_word_suffix") or ""
    spaces = {_METASPACE} | _replacements(spec.get("pre_tokenizer")) | _replacements(spec.get("decoder"))
    for piece, i in tokenizer.get_vocab(with_added_tokens=False).items():
        if byte_level and all(c in alphabet for c in piece):
            out[i] = len(piece)
            continue
        if byte_fallback and _BYTE_FALLBACK.fullmatch(piece):
            out[i] = 1
            continue
        if prefix and piece.startswith(prefix) and len(piece) > len(prefix):
            piece = piece[len(prefix) :]
        if suffix and piece.endswith(suffix):
            piece = piece[: -len(suffix)] + " "  # the suffix marks the end of a word: a space follows
        for s in spaces:
            piece = piece.replace(s, " ")
        out[i] = len(piece.encode("utf-8"))
    for i, added in tokenizer.get_added_tokens_decoder().items():
        out[i] = 0 if added.special else len(added.content.encode("utf-8"))
    return out


__all__ = [
    "END_OF_TEXT",
    "EOT",
    "Tok",
    "byte_lengths",
    "encode",
    "encode_batches",
    "fingerprint",
    "load",
    "load_saved",
    "save",
    "train",
]
