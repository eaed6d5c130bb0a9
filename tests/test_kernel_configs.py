"""The kernels' tile configs: the validated dataclasses, the data files (configs/*.json) and their lookup,
and the kernels package's import rules. The data's values are the tuning's business: these tests check
that every shipped tile is valid, that every bucket is covered and that bad tiles or files are refused."""

import ast
import copy
import itertools
import json
import pathlib

import pytest
import torch

from quads_megatron.errors import KernelConfigError
from quads_megatron.kernels import tile_configs
from quads_megatron.kernels.tile_configs import ActQuantConfig, MmaConfig, TritonGemmConfig, WgmmaConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
FACTS = {  # values of each condition a lookup is asked about
    "k": [None, 256, 768, 1024, 1040, 2048, 7168],
    "n": [64, 128, 192, 256, 384, 576, 1536, 2048, 4096, 4160],
    "out_bytes": [2, 4],
    "rac": [False, True],
    "dynamic": [False, True],
    "gated": [False, True],
}


def _rows_grid(rules: list[dict]) -> list[int]:
    edges = {r.get(key, 0) for r in rules for key in ("max_rows", "min_rows")} | {0, 1}
    return sorted({max(e + d, 0) for e in edges for d in (-1, 0, 1)} | {10 * max(edges) + 7})


def _fact_grid(kind: str):
    fact_of = {
        "max_k": "k",
        "n_multiple_of": "n",
        "out_bytes": "out_bytes",
        "rac": "rac",
        "dynamic": "dynamic",
        "gated": "gated",
    }
    names = [fact_of[c] for c in tile_configs.CONDITIONS[kind] if c in fact_of]
    for values in itertools.product(*(FACTS[c] for c in names)):
        yield dict(zip(names, values, strict=True))


@pytest.mark.parametrize("kind", tile_configs.KINDS)
def test_every_shipped_tile_is_valid_and_every_bucket_is_covered(kind):
    """The data file reads (load_table checks it), every tile builds its dataclass, and within each row
    bucket (a max_rows value) every combination of the other facts finds a rule of that bucket: no shape
    falls through to another bucket's tile."""
    table = tile_configs.load_table(kind)
    cls = {
        "triton_gemm": TritonGemmConfig,
        "wgmma_gemm": WgmmaConfig,
        "mma_gemm": MmaConfig,
        "act_quant": ActQuantConfig,
    }[kind]
    for device, entry in table["devices"].items():
        rules = entry["rules"]
        for rule in rules:
            cls(**rule["tile"])
        buckets = sorted({r["max_rows"] for r in rules if "max_rows" in r})
        for rows in _rows_grid(rules):
            for facts in _fact_grid(kind):
                facts = {**facts, "rows": rows}
                rule = next((r for r in rules if tile_configs.rule_holds(r, facts)), None)
                assert rule is not None, (device, facts)
                bucket = next((b for b in buckets if rows <= b), None)
                assert rule.get("max_rows") == bucket, (device, facts, rule)


def test_lookups_give_their_dataclass_for_every_shape():
    """The lookups on a dense grid: valid configs (the Triton GEMM's block_k the largest power of two up
    to the rule's that divides K; the activation quantization's block_k covering K with dynamic RAC)."""
    for rows, k in itertools.product([0, 1, 100, 4096, 4097, 16384, 16385, 10**6], range(16, 8193, 16)):
        cfg = tile_configs.triton_gemm_config(rows, k)
        ceiling = tile_configs.match_rule("triton_gemm", rows=rows, k=k)[1]["tile"]["block_k"]
        assert k % cfg.block_k == 0 and cfg.block_k <= ceiling
        assert cfg.block_k * 2 > ceiling or k % (cfg.block_k * 2)
        for plan, dynamic, gated in itertools.product((False, True), repeat=3):
            if plan and dynamic:
                continue
            a = tile_configs.act_quant_config(rows, k, plan, dynamic, gated)
            assert isinstance(a, ActQuantConfig) and None not in (a.block_m, a.block_k, a.num_warps)
            assert not dynamic or a.block_k >= k
    for rows, n, dtype in itertools.product([1, 1025, 20000], FACTS["n"], (torch.bfloat16, torch.float32)):
        assert isinstance(tile_configs.wgmma_config(rows, n, dtype), WgmmaConfig)
        assert isinstance(tile_configs.wgmma_faster_than_triton(rows), bool)
        assert isinstance(tile_configs.mma_used(rows), bool)
        for k in (256, 768, 2048):
            assert isinstance(tile_configs.mma_config(rows, k), MmaConfig)
    given = ActQuantConfig(block_m=8)  # fields given win, the others are tuned
    assert tile_configs.act_quant_config(64, 256, False, False, False, given=given).block_m == 8


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TritonGemmConfig(block_m=24), "block_m=24"),
        (lambda: TritonGemmConfig(block_k=8), "block_k=8"),
        (lambda: TritonGemmConfig(num_warps=3), "num_warps=3"),
        (lambda: TritonGemmConfig(num_stages=0), "num_stages=0"),
        (lambda: TritonGemmConfig(block_n=64.0), "must be an int"),
        (lambda: WgmmaConfig(block_t=24, num_warps=8, stages=3), "block_t=24"),
        (lambda: WgmmaConfig(block_t=16, num_warps=12, stages=3), "num_warps=12"),
        (lambda: WgmmaConfig(block_t=16, num_warps=8, stages=1), "stages=1"),
        (lambda: WgmmaConfig(block_t=16, num_warps=8, stages=3, chunks=3), "chunks=3"),
        (lambda: WgmmaConfig(block_t=16, num_warps=4, stages=3, loader_warps=4), "loader_warps=4"),
        (lambda: WgmmaConfig(block_t=16, num_warps=8, stages=3, maxnreg=512), "maxnreg=512"),
        (lambda: WgmmaConfig(block_t=16, num_warps=8, stages=3, ctas_per_sm=1), "ctas_per_sm=1"),
        (lambda: WgmmaConfig(block_t=16, num_warps=8, stages=3, split=True), "split=True"),
        (lambda: WgmmaConfig(block_t=16, num_warps=8, stages=3, narrow=True), "narrow=True"),
        (lambda: WgmmaConfig(block_t=16, num_warps=8, stages=3, tma_store=True), "tma_store=True"),
        (lambda: WgmmaConfig(block_t=16, num_warps=8, stages=3, split=1), "must be a bool"),
        (lambda: MmaConfig(block_t=64), "block_t=64"),
        (lambda: MmaConfig(num_warps=2), "num_warps=2"),
        (lambda: MmaConfig(row_groups=8), "row_groups=8"),
        (lambda: MmaConfig(weight_loads="cs"), "weight_loads"),
        (lambda: MmaConfig(chunks=3), "chunks=3"),
        (lambda: MmaConfig(prefetch=1), "must be a bool"),
        (lambda: ActQuantConfig(block_m=3), "block_m=3"),
        (lambda: ActQuantConfig(block_k=48), "block_k=48"),
        (lambda: ActQuantConfig(num_warps=32), "num_warps=32"),
        (lambda: ActQuantConfig(split_row=1), "split_row=1"),
    ],
)
def test_config_objects_refuse_tiles_the_kernels_cannot_run(make, match):
    with pytest.raises(KernelConfigError, match=match) as e:
        make()
    assert "\n" not in str(e.value)


def _table(kind: str) -> dict:
    return copy.deepcopy(tile_configs.load_table(kind))


def _bad_tables():
    t = _table("triton_gemm")
    t["default_device"] = "NVIDIA_B300"
    yield "triton_gemm", t, "default_device"
    t = _table("triton_gemm")
    t["devices"]["NVIDIA_H200"]["rules"][0]["n_multiple_of"] = 64  # not a condition of this kind
    yield "triton_gemm", t, "rule 0: needs a 'tile'; unknown keys {'n_multiple_of'}"
    t = _table("triton_gemm")
    t["devices"]["NVIDIA_H200"]["rules"][1]["tile"]["block_n"] = 96
    yield "triton_gemm", t, "rule 1: TritonGemmConfig.block_n=96"
    t = _table("triton_gemm")
    t["devices"]["NVIDIA_H200"]["rules"][-1]["max_rows"] = 10**9
    yield "triton_gemm", t, "the last rule must have no conditions"
    t = _table("mma_gemm")
    del t["devices"]["NVIDIA_H200"]["used_up_to_rows"]
    yield "mma_gemm", t, "used_up_to_rows"
    t = _table("wgmma_gemm")
    t["devices"]["NVIDIA_H200"]["rules"][2]["tile"]["warps"] = 8
    yield "wgmma_gemm", t, "rule 2: .*unexpected keyword argument 'warps'"
    t = _table("wgmma_gemm")
    del t["devices"]["NVIDIA_H200"]["faster_than_triton_above_rows"]
    yield "wgmma_gemm", t, "faster_than_triton_above_rows"
    t = _table("act_quant")
    t["devices"]["NVIDIA_H200"]["rules"][0]["tile"]["block_k"] = 128
    yield "act_quant", t, "an act_quant tile is block_m, num_warps"
    t = _table("act_quant")
    t["devices"]["NVIDIA_H200"]["rules"][0]["tile"]["split_row"] = "yes"
    yield "act_quant", t, "split_row='yes'"
    t = _table("act_quant")
    t["devices"]["NVIDIA_H200"]["chunk_k"] = 500
    yield "act_quant", t, "power-of-two chunk_k"


@pytest.mark.parametrize("kind, table, match", list(_bad_tables()))
def test_a_bad_data_file_is_refused_naming_what_is_wrong(kind, table, match):
    with pytest.raises(KernelConfigError, match=match) as e:
        tile_configs.check_table(kind, table, "configs/x.json")
    assert str(e.value).startswith("configs/x.json: ") and "\n" not in str(e.value)


def test_an_unreadable_data_file_is_refused_with_its_path(monkeypatch, tmp_path):
    path = tmp_path / "triton_gemm.json"
    path.write_text("{not json")
    monkeypatch.setattr(tile_configs, "config_path", lambda kind: str(path))
    tile_configs.load_table.cache_clear()
    try:
        with pytest.raises(KernelConfigError, match=f"{path}: cannot be read as JSON"):
            tile_configs.triton_gemm_config(16, 128)
    finally:
        tile_configs.load_table.cache_clear()


def test_a_named_device_gets_its_entry_and_others_the_default(monkeypatch):
    table = _table("triton_gemm")
    other = copy.deepcopy(table["devices"]["NVIDIA_H200"])
    other["rules"] = [{"tile": {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 2, "num_stages": 1}}]
    table["devices"]["NVIDIA_B300"] = other
    tile_configs.check_table("triton_gemm", table, "test")
    monkeypatch.setattr(tile_configs, "load_table", lambda kind: table)
    default = tile_configs.match_rule("triton_gemm", "cpu", rows=16, k=256)[1]["tile"]
    assert tile_configs.triton_gemm_config(16, 256, "cpu") == TritonGemmConfig(**{**default, "block_k": 256})
    monkeypatch.setattr(tile_configs, "device_key", lambda device: "NVIDIA_B300")
    assert tile_configs.triton_gemm_config(16, 256, "cuda") == TritonGemmConfig(32, 32, 32, 2, 1)
    monkeypatch.setattr(tile_configs, "device_key", lambda device: "NVIDIA_A100")
    assert tile_configs.triton_gemm_config(16, 256, "cuda") == TritonGemmConfig(**{**default, "block_k": 256})


def test_triton_rules_by_k_separate_fc2_from_fc1(monkeypatch):
    """A max_k rule gives its tile to GEMMs of inner size K <= max_k only (fc2 of a Qwen3-30B-A3B expert,
    K = 768, not its fc1, K = 2048), in both GEMMs' tables; a rule without max_k takes every K."""
    table, wg = _table("triton_gemm"), _table("wgmma_gemm")
    table["devices"]["NVIDIA_H200"]["rules"] = [
        {"max_k": 1024, "max_rows": 4096, "tile": {"block_m": 16, "block_n": 256, "block_k": 128, "num_warps": 8,
                                                   "num_stages": 4}},
        {"max_rows": 4096, "tile": {"block_m": 16, "block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 3}},
        {"tile": {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 2}},
    ]  # fmt: skip
    tile_configs.check_table("triton_gemm", table, "test")
    monkeypatch.setattr(tile_configs, "load_table", lambda kind: table)
    assert tile_configs.triton_gemm_config(128, 768) == TritonGemmConfig(16, 256, 128, 8, 4)
    assert tile_configs.triton_gemm_config(128, 1024) == TritonGemmConfig(16, 256, 128, 8, 4)
    assert tile_configs.triton_gemm_config(128, 2048) == TritonGemmConfig(16, 64, 256, 4, 3)
    assert tile_configs.triton_gemm_config(8192, 768) == TritonGemmConfig(64, 128, 128, 4, 2)
    fc2_tile = {"block_t": 32, "num_warps": 4, "stages": 4}
    wg["devices"]["NVIDIA_H200"]["rules"].insert(0, {"max_k": 1024, "n_multiple_of": 128, "tile": fc2_tile})
    tile_configs.check_table("wgmma_gemm", wg, "test")
    monkeypatch.setattr(tile_configs, "load_table", lambda kind: wg if kind == "wgmma_gemm" else table)
    assert tile_configs.wgmma_config(2048, 2048, k=768) == WgmmaConfig(**fc2_tile)
    assert tile_configs.wgmma_config(2048, 1536, k=2048) != WgmmaConfig(**fc2_tile)
    assert tile_configs.wgmma_config(2048, 2048) != WgmmaConfig(**fc2_tile)  # K not given: no max_k rule holds
    bad = copy.deepcopy(table)
    bad["devices"]["NVIDIA_H200"]["rules"][0]["min_k"] = 512
    with pytest.raises(KernelConfigError, match="unknown keys {'min_k'}"):
        tile_configs.check_table("triton_gemm", bad, "test")


def _tile_writer():
    """dev/tile_writer.py as a module (dev/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tile_writer", ROOT / "dev" / "tile_writer.py")
    tw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tw)
    return tw


def test_an_fc1_sweep_moves_fc2_copies_until_fc2_is_swept():
    """dev/tile_writer.py: a swept rule takes its winner; its max_k copy follows while it still holds the
    rule's old tile, not once fc2 has tiles of its own; rules nothing was timed in keep theirs."""
    tw = _tile_writer()
    a, b, c = ({"block_m": 16, "block_n": bn, "block_k": 128, "num_warps": 4, "num_stages": 3} for bn in (32, 64, 128))
    entry = {"rules": [
        {"max_k": 1024, "max_rows": 4096, "tile": dict(a)},
        {"max_k": 1024, "tile": dict(a)},
        {"max_rows": 4096, "tile": dict(a)},
        {"tile": dict(a)},
    ]}  # fmt: skip
    fc1 = [(2, 128, b, 10.0), (2, 128, c, 12.0), (2, 512, b, 20.0), (2, 512, c, 19.0)]  # b wins: 30 vs 31 us
    changes = tw.apply_winners(entry, "triton_gemm", "X", fc1)
    assert [r["tile"] for r in entry["rules"]] == [b, a, b, a] and len(changes) == 2, changes
    tw.apply_winners(entry, "triton_gemm", "X", [(0, 128, c, 5.0)])  # fc2's own sweep
    tw.apply_winners(entry, "triton_gemm", "X", [(2, 128, a, 1.0)])  # fc1 again: fc2's tile is its own now
    assert [r["tile"] for r in entry["rules"]] == [c, a, a, a]


def test_a_sweep_times_each_rules_current_tile_first():
    """dev/tile_writer.current_first: the probes time the rule's tile before any candidate (once), so a sweep
    cut short by its budget can still keep it."""
    tw = _tile_writer()
    assert tw.current_first((3,), [(1,), (2,), (3,), (4,)]) == [(3,), (1,), (2,), (4,)]
    assert tw.current_first({"b": 2}, [{"a": 1}]) == [{"b": 2}, {"a": 1}]


@pytest.mark.parametrize("kind", ["triton_gemm", "wgmma_gemm", "act_quant"])
def test_shipped_data_files_are_in_the_writers_format(kind):
    """dev/tile_writer.dumps_table writes what is shipped (one rule per line), so a sweep's diff shows only
    the rules it changed; and its text reads back as the same table."""
    tw = _tile_writer()
    text = (ROOT / "src" / "quads_megatron" / "kernels" / "configs" / f"{kind}.json").read_text()
    table = json.loads(text)
    assert tw.dumps_table(table) + "\n" == text
    rules = table["devices"][table["default_device"]]["rules"]
    assert len([ln for ln in text.splitlines() if '"tile": {' in ln]) >= len(rules)
    assert json.loads(tw.dumps_table(table)) == table


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and (
        node.value.id == "sys"
    )


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines that change the import path: sys.path.insert/append/extend/..., sys.path[...] = ..., or
    sys.path = ... (reading it, e.g. to restore it around a test of code that sets it, is fine)."""
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and _is_sys_path(n.func.value):
            lines.append(n.lineno)
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for t in targets:
            if _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)):
                lines.append(n.lineno)
    return sorted(lines)


def test_sys_path_edit_detector():
    edits = "import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path = []\nsys.path += ['z']\n"
    assert _sys_path_edits(ast.parse(edits)) == [2, 3, 4, 5]
    assert not _sys_path_edits(ast.parse("import sys\nsaved = list(sys.path)\nfirst = sys.path[0]\n"))


def test_kernels_import_the_contract_not_the_torch_reference_and_tests_not_dev():
    """Kernels may import the NVFP4 contract, the errors, the RAC plan types and each other, never the
    torch reference (or anything else of the package); no test reaches into dev/ (or edits sys.path)."""
    allowed = ("quads_megatron.kernels", "quads_megatron.nvfp4", "quads_megatron.errors")
    allowed += ("quads_megatron.rollout.rac_plan",)
    for path in sorted((ROOT / "src" / "quads_megatron" / "kernels").glob("*.py")):
        for name in _imports(path):
            assert name == "quads_megatron" or not name.startswith("quads_megatron") or name.startswith(allowed), (
                path.name,
                name,
            )
    dev = {p.stem for p in (ROOT / "dev").glob("*.py")}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        assert not {n.split(".")[0] for n in _imports(path)} & dev, path.name
    # no import-path edits outside dev/, but for the launcher, whose job is python's own: sys.path[0] is the
    # directory of the user's script it runs
    launcher = ROOT / "src" / "quads_megatron" / "launch.py"
    for top in ("src", "tests", "benchmarks", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            assert path == launcher or not _sys_path_edits(ast.parse(path.read_text())), path.relative_to(ROOT)


def test_data_files_are_package_data():
    """The JSON files ship with the package (pyproject's package-data) and are found where the loader looks."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '"quads_megatron.kernels" = ["configs/*.json"]' in text
    for kind in tile_configs.KINDS:
        assert json.loads(pathlib.Path(tile_configs.config_path(kind)).read_text())["devices"]
