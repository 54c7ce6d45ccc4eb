"""Configuration: presets, YAML, overrides, and one line naming the field for every refusal."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from moelab.config import Config, ConfigError, config_from_dict, config_hash, load_config, replace, to_dict
from moelab.presets import PRESETS


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds(name):
    cfg = load_config(name)
    assert isinstance(cfg, Config) and cfg.name == name


def test_hero_preset_has_marin_shape(marin):
    m = load_config("marin-535b-a23b").model
    h = marin["hero"]
    assert (m.d_model, m.n_layers, m.n_heads, m.head_size) == (h["d_model"], h["layers"], h["heads"], h["head_dim"])
    assert (m.kv_heads_local, m.n_kv_heads) == (h["kv_heads_local"], h["kv_heads_global"])
    assert (m.n_routed, m.top_k, m.expert_dim, m.latent_dim) == (
        h["routed_experts"],
        h["top_k"],
        h["expert_dim"],
        h["latent_dim"],
    )
    assert (m.n_shared, m.shared_dim, m.vocab_size, m.seq_len) == (
        h["shared_experts"],
        h["shared_dim"],
        h["vocab"],
        h["seq_len"],
    )
    assert (
        m.sliding_window == h["sliding_window"] and m.routed_scale == 2.5 and m.capacity_factor == h["capacity_factor"]
    )
    assert [m.is_global(i) for i in range(48)].count(True) == 12 and m.is_global(47)


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  d_model: 64\n  n_heads: 4\n  n_kv_heads: 2\ntrain:\n  lr: auto\n  steps: 7\n")
    cfg = load_config(path, ["model.top_k=1", "train.lr=0.01", "data.sources=[a, b]"])
    assert cfg.model.d_model == 64 and cfg.model.top_k == 1 and cfg.train.steps == 7
    assert cfg.train.lr == 0.01 and cfg.data.sources == ("a", "b")
    assert load_config(path).train.lr == "auto"


def test_numbers_in_scientific_notation(tmp_path):
    cfg = load_config("tiny", ["model.logit_z_loss=1e-4", "train.lr=3e-3"])
    assert cfg.model.logit_z_loss == 1e-4 and cfg.train.lr == 3e-3
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 3e-4\n  peak_flops: 1e12\n")
    assert load_config(path).train.lr == 3e-4 and load_config(path).train.peak_flops == 1e12


def test_ints_widen_to_floats_and_hash_tracks_content():
    a = load_config("tiny", ["model.capacity_factor=2"])
    assert a.model.capacity_factor == 2.0 and isinstance(a.model.capacity_factor, float)
    assert config_hash(a) == config_hash(load_config("tiny", ["model.capacity_factor=2.0"]))
    assert config_hash(a) != config_hash(load_config("tiny"))


def test_replace_validates():
    cfg = load_config("tiny")
    assert replace(cfg, model={"top_k": 3}).model.top_k == 3
    with pytest.raises(ConfigError, match="model.top_k"):
        replace(cfg, model={"top_k": 99})


def test_frozen():
    cfg = load_config("tiny")
    with pytest.raises(AttributeError):
        cfg.model.d_model = 3  # type: ignore[misc]


BAD = [
    ("model.d_modle=64", "model.d_modle"),  # unknown key
    ("model.d_model=wide", "model.d_model"),  # wrong type
    ("model.use_bias=true", "model.use_bias"),
    ("model.n_heads=3", "model.n_heads"),  # heads not dividing d_model (128)
    ("model.n_kv_heads=3", "model.n_kv_heads"),  # kv heads not dividing heads (4)
    ("model.n_kv_heads_local=3", "model.n_kv_heads_local"),
    ("model.top_k=9", "model.top_k"),  # top_k > routed experts (8)
    ("model.capacity_factor=0", "model.capacity_factor"),
    ("model.capacity_factor=-1", "model.capacity_factor"),
    ("model.latent_dim=256", "model.latent_dim"),  # latent larger than d_model
    ("model.sliding_window=512", "model.sliding_window"),  # window > seq_len (128)
    ("model.router=relu", "model.router"),
    ("model.dispatch=ragged", "model.dispatch"),
    ("model.bias_update=yes", "model.bias_update"),
    ("model.drop_order=random", "model.drop_order"),
    ("model.rope_fraction=0", "model.rope_fraction"),
    ("model.d_model=-8", "model.d_model"),
    ("train.steps=0", "train.steps"),
    ("train.lr=fast", "train.lr"),
    ("train.batch_size=1.5", "train.batch_size"),
    ("mesh.expert=3", "mesh.expert"),  # experts (8) not divisible by the expert axis
    ("optim.lr=1", "optim.lr"),  # unknown section
    ("model.n_kv_heads=0", "model.n_kv_heads"),
    ("model.n_heads=0", "model.n_heads"),
    ("model.capacity_factor=.inf", "model.capacity_factor"),
    ("model.rope_fraction=0.01", "model.rope_fraction"),
    ("model.capacity_group=100", "model.capacity_group"),  # does not divide 16 x 128 tokens
    ("data.phase_starts=[0.5, 0.8]", "data.phase_starts"),
    ("data.mixture=[{a: 1}, {a: 1}, {a: 1}]", "data.mixture"),
]


@pytest.mark.parametrize("override,field", BAD, ids=[b[0] for b in BAD])
def test_invalid_config_is_refused_with_one_line_naming_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    assert len(info.value.errors) == 1, info.value.errors
    assert info.value.errors[0].startswith(field), info.value.errors


def test_several_problems_give_one_line_each():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"top_k": 99, "capacity_factor": 0, "nope": 1}})
    lines = info.value.errors
    assert any(x.startswith("model.nope") for x in lines)
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"top_k": 99, "capacity_factor": 0.0}})
    assert sorted(x.split(":")[0] for x in info.value.errors) == ["model.capacity_factor", "model.top_k"]


@pytest.mark.parametrize("override,field", [BAD[0], BAD[1], BAD[6], BAD[9], BAD[20]])
def test_cli_refuses_with_exit_code_2_and_one_line(override, field):
    for command in ("config", "flops"):
        res = run_cli(command, "tiny", "--set", override)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and field in lines[0], res.stderr
        assert res.stdout == ""


def test_cli_refuses_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [1,\n")
    res = run_cli("config", str(bad))
    assert res.returncode == 2 and str(bad) in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = run_cli("config", str(tmp_path / "missing.yaml"))
    assert res.returncode == 2 and "missing.yaml" in res.stderr
    res = run_cli("config", "no-such-preset")
    assert res.returncode == 2 and "no-such-preset" in res.stderr
    res = run_cli("config", "tiny", "--set", "model.top_k")
    assert res.returncode == 2 and "model.top_k" in res.stderr


def test_cli_config_prints_the_resolved_config():
    res = run_cli("config", "tiny", "--set", "model.top_k=3")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["model"]["top_k"] == 3 and len(out["hash"]) == 12


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_every_preset_round_trips_through_moelab_config(fmt, tmp_path, capsys):
    """`moelab config X` prints a config that `moelab config` (and so train, plan and ladder, which read
    configs the same way) accepts as it is, hash included, and prints again unchanged."""
    from moelab.cli import main
    from moelab.presets import PRESETS

    for name in PRESETS:
        flag = ["--yaml"] if fmt == "yaml" else []
        assert main(["config", name, *flag]) == 0
        first = capsys.readouterr().out
        path = tmp_path / f"{name}.{fmt}"
        path.write_text(first)
        assert main(["config", str(path), *flag]) == 0
        assert capsys.readouterr().out == first, name
        assert config_hash(load_config(path)) == config_hash(load_config(name))


def test_a_runs_own_config_json_loads_and_its_hash_is_checked(tiny_run, tmp_path):
    saved = json.loads((tiny_run / "config.json").read_text())
    cfg = load_config(tiny_run / "config.json")
    assert config_hash(cfg) == saved["hash"] and json.loads(json.dumps(to_dict(cfg))) == saved["config"]
    edited = json.loads(json.dumps(saved))
    edited["config"]["model"]["d_model"] = 96
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "edited.json")
    assert len(exc.value.errors) == 1 and f"hash {saved['hash']} is not its fields'" in exc.value.errors[0]
    del edited["hash"]  # the edit kept: no hash, no check
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    assert load_config(tmp_path / "edited.json").model.d_model == 96


def test_a_yaml_config_starts_from_a_base_and_overrides_at_any_depth(tmp_path):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "base.yaml").write_text(
        "base: tiny\nmodel: {d_model: 96}\ndata: {sources: {code: [a/], prose: [b/]}, text_field: {prose: body}}\n"
    )
    (tmp_path / "mine.yaml").write_text(  # a base relative to this file; a domain added to the mapping
        "base: lab/base.yaml\ntrain: {steps: 7}\ndata: {sources: {web: [c/]}}\n"
    )
    cfg = load_config(tmp_path / "mine.yaml", ["model.top_k=1"])
    tiny = load_config("tiny")
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.train.steps, cfg.model.top_k) == (96, tiny.model.n_layers, 7, 1)
    assert cfg.data.sources == {"code": ("a/",), "prose": ("b/",), "web": ("c/",)}
    assert cfg.data.text_field == {"prose": "body"}
    (tmp_path / "loop.yaml").write_text("base: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="the chain of bases comes back"):
        load_config(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="nosuch.yaml: no such config file"):
        load_config(_write(tmp_path / "bad.yaml", "base: nosuch.yaml\n"))


def _write(path, text):
    path.write_text(text)
    return path


def test_moelab_config_refuses_what_training_would(capsys):
    from moelab.cli import main

    assert main(["config", "tiny", "--set", "model.vocab_size=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.vocab_size: 1 is below the 257 tokens" in err[0]


def test_set_reaches_into_mapping_fields():
    cfg = load_config("tiny", ["data.text_field.prose=body", "data.sources.code=[a/, b/]"])
    assert cfg.data.text_field == {"prose": "body"} and cfg.data.sources == {"code": ("a/", "b/")}
    with pytest.raises(ConfigError, match="model.d_model is not a mapping; set it whole"):
        load_config("tiny", ["model.d_model.x=1"])


# ---------------------------------------------------------------- meanings: `moelab config --explain`


def _all_fields():
    """Every field of every config class, read from the dataclasses themselves (not from moelab's list)."""
    import dataclasses

    from moelab.config import SECTIONS

    out = [(f"{s}.{f.name}", f, cls) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    return out + [("name", f, Config) for f in dataclasses.fields(Config) if f.name == "name"]


def test_every_field_has_a_meaning_and_explain_prints_it(capsys):
    from moelab.cli import main

    fields = _all_fields()
    assert len(fields) > 100
    for path, f, cls in fields:
        meaning = f.metadata.get("help", "")
        assert len(meaning) >= 30 and meaning.endswith((".", ")")), (path, meaning)
        assert main(["config", "--explain", path]) == 0, path
        out = capsys.readouterr().out
        head, *rest = out.splitlines()
        assert head.startswith(f"{path} ("), out
        assert " ".join(" ".join(rest).split()).endswith(" ".join(meaning.split())), out  # wrapped, whole
        default = getattr(cls(), f.name)  # the class's own default, built here
        assert f"  default: {json.dumps(default)}" in rest, (path, out)


def test_explain_shows_the_config_value_beside_the_default(capsys):
    from moelab.cli import main

    assert main(["config", "tiny", "--explain", "model.router"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [  # tiny routes by sigmoid (presets.py); the class's default is softmax
        "model.router (string)",
        '  default: "softmax"',
        '  in tiny: "sigmoid"',
        '  choices: "softmax", "sigmoid"',
    ]
    assert main(["config", "tiny", "--set", "model.d_model=96", "--explain", "model.d_model"]) == 0
    assert "  in tiny: 96" in capsys.readouterr().out.splitlines()


def test_explain_a_section_lists_its_fields_one_line_each(capsys):
    from moelab.cli import main
    from moelab.config import MeshConfig

    assert main(["config", "--explain", "mesh"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mesh: ") and len(lines) == 2 + 3
    assert [x.split()[0] for x in lines[2:]] == ["data", "expert", "fsdp"]
    for line, f in zip(lines[2:], __import__("dataclasses").fields(MeshConfig), strict=True):
        assert line.split()[1] == json.dumps(f.default) and f.metadata["help"].startswith(line.split(None, 2)[2])


@pytest.mark.parametrize(
    "name,nearest", [("model.top_kk", "model.top_k"), ("top_k", "model.top_k"), ("optim.lr", "train.lr")]
)
def test_explain_an_unknown_field_is_one_line_with_the_nearest_names(name, nearest, capsys):
    from moelab.cli import main

    assert main(["config", "--explain", name]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"moelab: {name}: no such config field; did you mean ") and nearest in err


def test_the_allowed_values_of_a_field_are_what_its_check_accepts():
    """A field's listed choices (shown by --explain and the reference) are exactly what validation takes."""
    from moelab.config import SECTIONS, explain

    for path, f, _ in _all_fields():
        if "choices" not in f.metadata:
            continue
        section, key = path.split(".")
        assert explain(path)["choices"] == f.metadata["choices"]
        for value in f.metadata["choices"]:
            assert SECTIONS[section](**{key: value}).check() == [], (path, value)
        problems = SECTIONS[section](**{key: "no-such-value"}).check()
        assert len(problems) == 1 and problems[0].startswith(path), (path, problems)


def test_meanings_leave_every_hash_as_it_was():
    """Field metadata enters no hash: the hashes recorded before the fields carried their meanings."""
    assert config_hash(load_config("tiny")) == "d68c6842fca8"
    assert config_hash(load_config("marin-535b-a23b")) == "77e2a7fe5e84"
    assert config_hash(load_config({})) == "c16bcb5732df"


def test_the_config_package_imports_nothing_above_it():
    """moelab.config lies below everything that reads a config: its modules import, at their top and
    nowhere else, only each other and the modules below (errors, presets, the schedule's parser)."""
    import ast
    from pathlib import Path

    import moelab.config

    below = ("moelab.errors", "moelab.presets", "moelab.schedule")
    for path in sorted(Path(moelab.config.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in (n for n in names if n == "moelab" or n.startswith("moelab.")):
                assert name.startswith("moelab.config.") or name in below, (path.name, name)
                assert node in top, f"{path.name}: {name} imported inside a function"
