"""The generated reference pages: equal to what the code gives now, complete, and independent of the
terminal; `python -m moelab.docgen --check` says which page is stale."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from moelab import docgen
from moelab.cli import build_parser
from moelab.config import SECTIONS, Config
from moelab.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("rel", list(docgen.PAGES))
def test_the_committed_page_is_what_the_code_generates(rel):
    committed = (ROOT / rel).read_text(encoding="utf-8")
    assert committed == docgen.PAGES[rel](), f"{rel} is stale: run python -m moelab.docgen and commit it"


def test_every_config_field_and_preset_is_in_the_configuration_reference():
    page = (ROOT / "docs/reference/config.md").read_text(encoding="utf-8")
    rows = {line.split(" | ")[0][3:-1]: line for line in page.splitlines() if line.startswith("| `")}
    for section, cls in SECTIONS.items():  # the dataclasses' own fields, not docgen's list of them
        assert f"\n## {section}\n" in page
        for f in dataclasses.fields(cls):
            row = rows[f"{section}.{f.name}"]
            assert row.count(" | ") == 3 and len(row.split(" | ")[3]) >= 30, row  # type, default and a meaning
    assert "name" in rows and {f.name for f in dataclasses.fields(Config)} - set(SECTIONS) == {"name"}
    for name in PRESETS:
        assert name in rows


def _commands(parser, prefix="moelab"):
    """Every command and subcommand, walked here from the parser itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _commands(sub, f"{prefix} {name}")


def test_every_command_is_in_the_cli_reference_with_its_usage_and_arguments():
    page = (ROOT / "docs/reference/cli.md").read_text(encoding="utf-8")
    headings = [line.lstrip("#").strip() for line in page.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings))  # unique heading text: unique anchors
    commands = list(_commands(build_parser()))
    assert len(commands) >= 20
    for name, parser in commands:
        assert name in headings, name
        section = page.split(f"# {name}\n", 1)[1].split("\n#", 1)[0]
        assert f"```text\n{name} [-h]" in section, name
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert f"| `{action.option_strings[0]}" in section, (name, action.option_strings)
    assert "\x1b[" not in page  # no terminal colours


def test_the_pages_do_not_depend_on_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = {rel: render() for rel, render in docgen.PAGES.items()}
    monkeypatch.setenv("COLUMNS", "250")
    assert {rel: render() for rel, render in docgen.PAGES.items()} == narrow


def test_check_lists_the_stale_pages_and_writing_makes_them_current(tmp_path, capsys):
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 1  # none written yet
    assert [line.split(":")[0] for line in capsys.readouterr().err.splitlines()] == list(docgen.PAGES)
    assert docgen.main(["--root", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 0
    page = tmp_path / "docs/reference/config.md"
    page.write_text(page.read_text().replace("model.top_k", "model.topk"))
    capsys.readouterr()
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "docs/reference/config.md: stale; run python -m moelab.docgen to write it"
    ]
