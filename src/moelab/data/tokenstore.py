"""A built token store, read: its manifest, its tokens memory-mapped, its documents' index and its tokenizer.

A store's folder (``store-<key>`` under the cache, built by ``moelab.data.store.build_store``) holds
``tokens.bin`` (every domain's training then held-out tokens, documents joined by EOT),
``documents.bin`` (one ``INDEX`` row per document), ``byte_lengths.npy``, the tokenizer, a store of
conversations ``mask.bin`` (one byte per token: 1 where it counts in the loss), and ``manifest.json``,
written last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.data import tokenizer as T

INDEX = np.dtype(
    [("domain", "<u2"), ("split", "u1"), ("unit", "<u4"), ("file", "<u4"), ("row", "<u8"),
     ("start", "<u8"), ("tokens", "<u8"), ("bytes", "<u8")]
)  # fmt: skip
SPLITS = ("train", "heldout")


@dataclass
class TokenStore:
    path: Path
    manifest: dict
    tokens: np.ndarray  # memory-mapped, all domains and splits
    byte_lengths: np.ndarray  # [vocab] bytes per token id

    @property
    def domains(self) -> list[str]:
        """The domains trained on (validation domains are not among them)."""
        return list(self.manifest["domains"])

    @property
    def validation(self) -> list[str]:
        """Domains that are only evaluated (``data.validation``): held out whole."""
        return list(self.manifest.get("validation", []))

    @property
    def eval_domains(self) -> list[str]:
        return self.domains + self.validation

    @property
    def eot(self) -> int:
        return int(self.manifest["eot"])

    def stream(self, domain: str, split: str) -> np.ndarray:
        """A domain's training or held-out tokens, documents joined by EOT. split: train | heldout."""
        start, end = self.manifest["spans"][domain][split]
        return self.tokens[start:end]

    def mask(self, domain: str, split: str) -> np.ndarray | None:
        """A store of conversations: which of the stream's tokens count in the loss (uint8, 1 = the
        assistant's), aligned with ``stream``; None for a store without conversations."""
        if not self.manifest.get("mask"):
            return None
        start, end = self.manifest["spans"][domain][split]
        n = self.manifest["n_tokens"]
        return np.memmap(self.path / "mask.bin", dtype=np.uint8, mode="r", shape=(n,))[start:end]

    def documents(self) -> np.ndarray:
        """Every document: domain index (into domains + validation), split, unit, file, row, start,
        tokens and bytes, memory-mapped."""
        path = self.path / "documents.bin"
        n = path.stat().st_size // INDEX.itemsize
        return np.memmap(path, dtype=INDEX, mode="r", shape=(n,)) if n else np.zeros(0, INDEX)

    def doc_name(self, doc) -> str:
        """Where a document comes from: its shard's name and its row (line, row or piece)."""
        files = self.manifest["units"][int(doc["unit"])]["files"]
        return f"{files[int(doc['file'])]}#{int(doc['row'])}"

    def tokenizer(self):
        return T.load_saved(self.path).tokenizer

    def tok(self) -> T.Tok:
        return T.load_saved(self.path)


def open_store(path: Path) -> TokenStore:
    manifest = json.loads((path / "manifest.json").read_text())
    n = manifest["n_tokens"]
    tokens = (
        np.memmap(path / "tokens.bin", dtype=manifest["dtype"], mode="r", shape=(n,))
        if n
        else np.zeros(0, manifest["dtype"])
    )
    return TokenStore(path, manifest, tokens, np.load(path / "byte_lengths.npy"))
