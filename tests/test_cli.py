"""`quads` command line: exit codes, one-line errors, refusals before any write, Ctrl-C and resume,
progress, help and version."""

import argparse
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from quads_megatron import __version__
from quads_megatron.checkpoint import output as convert_output
from quads_megatron.cli import EXIT_INPUT, EXIT_INTERRUPTED, build_parser, main
from test_convert import E, L, hf_moe_state, read_all, write_hf


def tree(path) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def one_line_error(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("quads convert: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


@pytest.fixture
def src(tmp_path):
    return write_hf(tmp_path / "hf", hf_moe_state())


def all_modules(value=4.0) -> dict[str, float]:
    return {
        f"model.layers.{i}.mlp.experts.{e}.{p}": value
        for i in range(L)
        for e in range(E)
        for p in ("gate_proj", "up_proj", "down_proj")
    }


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"quads {__version__}"
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest for c in sub._choices_actions} == {"convert", "demo", "rl"}  # demo: megatron-core imports here
    assert all(c.help for c in sub._choices_actions)
    convert = sub.choices["convert"]
    for action in convert._actions:
        assert action.help and action.help != argparse.SUPPRESS, action.dest
    text = convert.format_help()
    for words in ("exit status", "130", "--input-amax", "flat object", "<moe prefix>.w13", "DST.lock"):
        assert words in text, words
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    rl = sub.choices["rl"]
    for action in rl._actions:
        assert action.help and action.help != argparse.SUPPRESS, action.dest
    text = rl.format_help()
    for words in ("--dry-run", "--budget-s", "75 stopped at the time budget", "racR (QAT + RAC R%)"):
        assert words in text, words


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "only-src"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["convert", "a", "b", "--no-such-flag"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["convert", "a", "b", "--verify-only", "--megatron-base-hf", "c"])
    assert e.value.code == 2 and "for a Megatron one use --verify" in capsys.readouterr().err


def bad_amax_files(tmp_path) -> list[tuple[str, str]]:
    cases = {
        "nested.json": ('{"model.layers.0.mlp.experts.0.gate_proj": {"amax": 1}}', "is dict"),
        "list.json": ("[1, 2]", "expected a flat JSON object"),
        "nan.json": ('{"model.layers.0.mlp.experts.0.gate_proj": NaN}', "experts.0.gate_proj is nan"),
        "neg.json": ('{"model.layers.0.mlp.experts.0.gate_proj": -3}', "experts.0.gate_proj is -3"),
        "zero.json": ('{"model.layers.0.mlp.experts.0.gate_proj": 0}', "experts.0.gate_proj is 0"),
        "text.json": ('{"model.layers.0.mlp.experts.0.gate_proj": "12"}', "is str"),
        "broken.json": ("{", "not valid JSON"),
        "amax.txt": ("1", "must be .json or .safetensors"),
    }
    out = []
    for name, (text, msg) in cases.items():
        (tmp_path / name).write_text(text)
        out.append((str(tmp_path / name), msg))
    save_file(
        {"model.layers.0.mlp.experts.0.up_proj": torch.tensor([1.0, float("inf")])}, str(tmp_path / "inf.safetensors")
    )
    out.append((str(tmp_path / "inf.safetensors"), "experts.0.up_proj has non-finite values"))
    partial = all_modules()
    partial.pop("model.layers.1.mlp.experts.3.down_proj")
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    out.append((str(tmp_path / "partial.json"), "covers 23 of 24 quantized modules"))
    return out


def test_bad_input_amax_is_refused_before_any_write(src, tmp_path, capsys):
    calib = tmp_path / "calib"
    calib.mkdir()
    for path, msg in bad_amax_files(calib):
        rc = main(["convert", str(src), str(tmp_path / "out"), "--quiet", "--input-amax", path])
        assert rc == EXIT_INPUT, path
        one_line_error(capsys, msg)
        assert sorted(os.listdir(tmp_path)) == ["calib", "hf"], path


def test_bad_plans_and_rollout_settings_are_refused_before_any_write(src, tmp_path, capsys):
    def plans(path, **tensors):
        save_file({k.replace("__", "."): torch.tensor(v) for k, v in tensors.items()}, str(path))
        return str(path)

    one_layer = plans(
        tmp_path / "one.safetensors", **{"model.layers.0.mlp.experts.w13": [0], "model.layers.0.mlp.experts.w2": [0]}
    )
    both = {f"model.layers.{i}.mlp.experts.{g}": [1] for i in range(L) for g in ("w13", "w2")}
    wide = plans(tmp_path / "wide.safetensors", **{**both, "model.layers.1.mlp.experts.w13": [2]})  # K=32: 2 blocks
    good = plans(tmp_path / "good.safetensors", **both)
    (tmp_path / "static.yaml").write_text("rollout:\n  rac: {selection: static, ratio: 0.25}\n")
    (tmp_path / "act.yaml").write_text("rollout:\n  activation_scale: static\n")
    (tmp_path / "typo.yaml").write_text("rollout:\n  rak: {}\n")
    (tmp_path / "amax.json").write_text(json.dumps(all_modules()))
    cases = [
        (["--rac-plans", one_layer], "cover 1 of 2 MoE layers converted; no plan for ['model.layers.1.mlp.experts']"),
        (["--rac-plans", wide], "model.layers.1.mlp.experts.w13: block index 2 is out of range [0, 2) for K=32"),
        (["--quads-config", str(tmp_path / "static.yaml")], "selection is static but no RAC plans"),
        (["--quads-config", str(tmp_path / "act.yaml"), "--rac-plans", good], "activation_scale is static"),
        (["--quads-config", str(tmp_path / "typo.yaml")], "typo.yaml: rollout.rak: unknown key"),
        (["--rac-plans", str(tmp_path / "missing.safetensors")], "missing.safetensors: no such RAC plan file"),
    ]
    before = sorted(os.listdir(tmp_path))
    for extra, msg in cases:
        assert main(["convert", str(src), str(tmp_path / "out"), "--quiet", *extra]) == EXIT_INPUT, extra
        one_line_error(capsys, msg)
        assert sorted(os.listdir(tmp_path)) == before
    ok = ["--quads-config", str(tmp_path / "static.yaml"), "--rac-plans", good]
    assert (
        main(["convert", str(src), str(tmp_path / "out"), "--quiet", *ok, "--input-amax", str(tmp_path / "amax.json")])
        == 0
    )


def test_overwrite_refuses_the_source_and_the_working_directory(src, tmp_path, monkeypatch, capsys):
    before = tree(tmp_path)
    assert main(["convert", str(src), str(src), "--overwrite", "--quiet"]) == EXIT_INPUT
    one_line_error(capsys, f"{src}: refusing to remove it: it is the source")
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "hf", ".", "--overwrite", "--quiet"]) == EXIT_INPUT
    one_line_error(capsys, "refusing to remove it: it is the working directory")
    assert main(["convert", "hf/", "hf/../hf", "--overwrite", "--quiet"]) == EXIT_INPUT
    one_line_error(capsys, "it is the source")
    assert tree(tmp_path) == before


def test_ctrl_c_keeps_the_partial_and_the_same_command_resumes(src, tmp_path, monkeypatch, capsys):
    real_save, calls = convert_output.save_file, []

    def save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(convert_output, "save_file", save)
    cmd = ["convert", str(src), str(tmp_path / "out"), "--quiet"]
    assert main(cmd) == EXIT_INTERRUPTED
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "warning" not in x]
    assert err == [
        f"quads convert: interrupted; the partial output {tmp_path}/out.partial is kept: run the same command "
        "again to resume"
    ]
    assert (tmp_path / "out.partial").is_dir() and not (tmp_path / "out").exists()
    monkeypatch.setattr(convert_output, "save_file", real_save)
    assert main(cmd[:-1]) == 0
    err = capsys.readouterr().err
    assert "resuming: 1 of 2 shards already done" in err
    assert main(["convert", str(src), str(tmp_path / "out"), "--verify-only"]) == 0


def test_progress_for_every_phase_and_quiet_silences_it(src, tmp_path, capsys):
    assert main(["convert", str(src), str(tmp_path / "out"), "--verify"]) == 0
    err = capsys.readouterr().err
    for phase in ("scan 2/2", "amax 2/2", "write 2/2", "verify 2/2"):
        assert f"quads convert: {phase}" in err, phase
    assert "warning: no --input-amax: every quantized linear gets input_scale 1.0 (activation amax 2688)" in err
    (tmp_path / "amax.json").write_text(json.dumps(all_modules()))
    cmd = [
        "convert",
        str(src),
        str(tmp_path / "out2"),
        "--verify",
        "--quiet",
        "--input-amax",
        str(tmp_path / "amax.json"),
    ]
    assert main(cmd) == 0
    assert capsys.readouterr().err == ""
    assert read_all(tmp_path / "out2")["model.layers.0.mlp.experts.0.up_proj.input_scale"].item() == pytest.approx(
        4 / 2688
    )
