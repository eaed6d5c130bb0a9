"""Two ways to apply QUADS without editing the training script: the launcher (python -m
quads_megatron.launch SCRIPT) and the QUADS_CONFIG startup hook installed with the package (for
workers that never run the launcher, e.g. Ray actors). Both are exercised in spawned processes;
the hook through a real wheel install and a real editable install into fresh virtual environments."""

import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import quads_megatron
from quads_megatron import _startup
from quads_megatron.errors import QuadsConfigError
from quads_megatron.integrations.megatron import qat as megatron_core

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(quads_megatron.__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import sibling_helper  # a module next to the script: needs the script's directory on sys.path
    import quads_megatron
    print(json.dumps({"file": __file__, "argv": sys.argv, "path0": sys.path[0], "name": __name__,
                      "helper": sibling_helper.VALUE, "applied": quads_megatron.is_applied()}))
    """
)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QUADS_CONFIG")}
    env.update(extra)
    return env


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def project(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(SCRIPT)
    (proj / "sibling_helper.py").write_text("VALUE = 7\n")
    return tmp_path


# ----------------------------------------------------------------------------- launcher


def test_launcher_runs_the_script_as_python_does(project):
    args = ["proj/train.py", "--lr", "1e-4", "pos"]
    env = child_env(PYTHONPATH=str(SRC))
    plain = subprocess.run([sys.executable, *args], cwd=project, env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    launched = subprocess.run(
        [sys.executable, "-m", "quads_megatron.launch", *args], cwd=project, env=env, capture_output=True, text=True
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    want, got = last_json(plain.stdout), last_json(launched.stdout)
    assert got.pop("applied") is True and want.pop("applied") is False
    assert got == want  # __file__, argv, sys.path[0] (the script's directory), __name__, sibling import
    assert want["path0"] == str(project / "proj") and want["argv"] == args


def test_run_script_resolves_a_symlinked_script_directory(project, monkeypatch):
    from quads_megatron import launch

    link_dir = project / "links"
    link_dir.mkdir()
    (link_dir / "run.py").symlink_to(project / "proj" / "train.py")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    monkeypatch.delitem(sys.modules, "sibling_helper", raising=False)
    monkeypatch.chdir(project)
    plain = subprocess.run(
        [sys.executable, "links/run.py", "x"],
        cwd=project,
        env=child_env(PYTHONPATH=str(SRC)),
        capture_output=True,
        text=True,
    )
    buf = io.StringIO()
    with redirect_stdout(buf):
        launch.run_script(["links/run.py", "x"])
    want, got = last_json(plain.stdout), last_json(buf.getvalue())
    assert want["path0"] == str(project / "proj")  # python resolves the link to find the directory
    want.pop("applied"), got.pop("applied")
    assert got == want


def test_launcher_refuses_a_missing_script(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "quads_megatron.launch", "nope.py"],
        cwd=tmp_path,
        env=child_env(PYTHONPATH=str(SRC)),
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "'nope.py' is not a file" in res.stderr
    assert "Traceback" not in res.stderr


# ----------------------------------------------------------------------------- startup hook: real installs

CHILD = textwrap.dedent(
    """
    import json, sys
    start = sorted(m for m in ("torch", "megatron", "yaml", "quads_megatron", "quads_megatron._startup")
                   if m in sys.modules)
    if len(sys.argv) > 1:  # build a real megatron-core MoE layer, as a Ray worker would
        from quads_megatron.demo.cpu_megatron import (
            build_moe_layer, init_distributed, install_cpu_shims_for_megatron, moe_config)
        install_cpu_shims_for_megatron()
        init_distributed()
        layer = build_moe_layer(moe_config())
        import quads_megatron
        from quads_megatron.integrations.megatron import qat
        tags = [m._quads_target.linear for m in layer.modules() if hasattr(m, "_quads_target")]
        print(json.dumps({"start": start, "tags": len(tags), "applied": quads_megatron.is_applied(),
                          "linears": qat.STATE.config.trainer.linears, "package": quads_megatron.__file__}))
    else:
        print(json.dumps({"start": start}))
    """
)


def _can_build_offline() -> bool:
    """setuptools with a built-in (>= 70.1) or installed bdist_wheel in this interpreter."""
    import importlib.util

    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _make_venv(path: Path) -> tuple[Path, Path]:
    """A fresh venv (no pip) that also sees this interpreter's site-packages (torch, megatron-core)
    as plain path entries (their .pth files are not run); returns (python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "_test_parent_site.pth").write_text("".join(f"{p}\n" for p in sorted(deps)))
    return python, site


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    """The package installed from a copy of this tree: as a wheel and as an editable install."""
    base = tmp_path_factory.mktemp("startup_hook")
    copy = base / "project"
    copy.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, copy / name)
    shutil.copytree(
        SRC / "quads_megatron", copy / "src" / "quads_megatron", ignore=shutil.ignore_patterns("__pycache__")
    )
    offline = ["--no-build-isolation", "--no-index"] if _can_build_offline() else []
    out = {}
    for kind, editable in (("wheel", []), ("editable", ["-e"])):
        python, site = _make_venv(base / f"venv_{kind}")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                *offline,
                "--target",
                str(site),
                *editable,
                str(copy),
            ],
            check=True,
            env=child_env(),
            cwd=base,
        )
        out[kind] = (python, site, copy)
    return out


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_startup_hook_lands_at_the_site_packages_root(installs, kind):
    python, site, copy = installs[kind]
    pth = site / _startup.PTH_NAME
    assert pth.read_text() == _startup.PTH_LINE
    if kind == "wheel":
        assert (site / "quads_megatron" / "_startup.py").is_file()
        record = next(site.glob("quads_megatron-*.dist-info")) / "RECORD"
        assert f"{_startup.PTH_NAME}," in record.read_text()  # pip uninstall removes it
    else:
        assert not (site / "quads_megatron").exists()
        (editable_pth,) = site.glob("__editable__.quads_megatron-*.pth")
        assert str((copy / "src").resolve()) in editable_pth.read_text()


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_startup_hook_applies_quads_in_a_fresh_process(installs, kind, tmp_path):
    python, site, copy = installs[kind]
    cfg = tmp_path / "quads.yaml"
    cfg.write_text("trainer:\n  linears: [fc2]\n")
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    res = subprocess.run(
        [str(python), str(child), "build"],
        env=child_env(QUADS_CONFIG=str(cfg)),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = last_json(res.stdout)
    assert got["start"] == ["quads_megatron", "quads_megatron._startup"]  # no torch / megatron / yaml at start
    assert got["applied"] and got["tags"] == 8  # 4 experts x (fc1, fc2) tagged at construction
    assert got["linears"] == ["fc2"]  # the YAML's trainer.linears: what the forward fake-quantizes
    want_pkg = site / "quads_megatron" if kind == "wheel" else copy / "src" / "quads_megatron"
    assert Path(got["package"]).parent == want_pkg
    quiet = subprocess.run([str(python), str(child)], env=child_env(), capture_output=True, text=True)
    assert quiet.returncode == 0 and last_json(quiet.stdout)["start"] == []  # no QUADS_CONFIG: nothing imported
    assert quiet.stderr == ""


def test_startup_hook_failures_print_one_line(installs, tmp_path):
    python, _, _ = installs["wheel"]
    res = subprocess.run(
        [str(python), "-c", "print('ok')"],
        env=child_env(QUADS_CONFIG=str(tmp_path / "no.yaml")),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and res.stdout == "ok\n"
    assert res.stderr.count("\n") == 1 and "quads_megatron: QUADS_CONFIG=" in res.stderr and "no.yaml" in res.stderr
    broken, site = _make_venv(tmp_path / "broken")  # the .pth without an importable package
    (site / _startup.PTH_NAME).write_text(_startup.PTH_LINE)
    res = subprocess.run(
        [str(broken), "-c", "print('ok')"], env=child_env(QUADS_CONFIG="x.yaml"), capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout == "ok\n"
    assert (
        res.stderr == "quads_megatron: QUADS_CONFIG startup hook not loaded: ModuleNotFoundError: "
        "No module named 'quads_megatron'\n"
    )


# ----------------------------------------------------------------------------- startup hook: in this process


@pytest.fixture
def startup_state(megatron_world, clean_quads_patches):
    _startup.disarm()
    _startup._STATE["activated"] = False
    yield
    _startup.disarm()
    _startup._STATE["activated"] = False


def test_deferred_apply_at_the_first_moe_layer(startup_state, monkeypatch, tmp_path):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from quads_megatron.demo.cpu_megatron import build_moe_layer, moe_config

    original = MoELayer.__init__
    cfg = tmp_path / "q.yaml"
    cfg.write_text("trainer:\n  linears: [fc1]\n")
    monkeypatch.setenv("QUADS_CONFIG", str(cfg))
    assert _startup.activate() and _startup.activate()  # idempotent (site may run the line twice)
    assert _startup.is_armed() and not quads_megatron.is_applied()  # megatron already imported: wrapped now
    layer = build_moe_layer(moe_config(), seed=0)
    assert quads_megatron.is_applied() and not _startup.is_armed()
    assert sum(hasattr(m, "_quads_target") for m in layer.modules()) == 8
    assert megatron_core.STATE.config.trainer.linears == ("fc1",)  # from QUADS_CONFIG
    quads_megatron.remove()
    assert MoELayer.__init__ is original  # apply() replaced the deferred wrapper; remove() restores


def test_bad_config_keeps_every_moe_layer_from_building(startup_state, monkeypatch, tmp_path):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from quads_megatron.demo.cpu_megatron import build_moe_layer, moe_config

    cfg = tmp_path / "q.yaml"
    cfg.write_text("trainer:\n  scale_mode: row\n")
    monkeypatch.setenv("QUADS_CONFIG", str(cfg))
    _startup.activate()
    for _ in range(2):  # stays armed: no layer trains without the QAT it asked for
        with pytest.raises(QuadsConfigError, match=r"QUADS_CONFIG=.*startup hook.*trainer\.scale_mode"):
            build_moe_layer(moe_config(), seed=0)
    assert _startup.is_armed() and not quads_megatron.is_applied()
    quads_megatron.apply({})  # an explicit apply() (the launcher's) takes over and disarms the hook
    assert not _startup.is_armed() and MoELayer.__init__.__wrapped__ is _startup_original(MoELayer)
    layer = build_moe_layer(moe_config(), seed=0)
    assert hasattr(layer.experts.local_experts[0].linear_fc1, "_quads_target")
    layer(torch.randn(4, 2, 32))


def _startup_original(cls):
    """MoELayer.__init__ as megatron-core defines it (under the QUADS wrapper)."""
    init = cls.__init__
    while hasattr(init, "__wrapped__"):
        init = init.__wrapped__
    return init
