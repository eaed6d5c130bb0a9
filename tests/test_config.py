"""YAML config: defaults, round trip, and errors that name the bad key."""

import re
from pathlib import Path

import pytest

from quads_megatron.config import QuadsConfig, QuadsConfigError, RACConfig, load_config
from quads_megatron.nvfp4 import NVFP4Recipe


def test_defaults_and_yaml_roundtrip(tmp_path):
    cfg = QuadsConfig()
    assert cfg.trainer.linears == ("fc1", "fc2") and cfg.rollout.rac.ratio == 0.5
    p = tmp_path / "q.yaml"
    p.write_text(
        "trainer:\n  experts: [routed, shared]\n  layers: [2, 3]\n  scale_mode: tensor\n"
        "rollout:\n  activation_scale: static\n  rac: {ratio: 0.5, selection: dynamic, metric: amax}\n"
    )
    got = load_config(p)
    assert got.trainer.experts == ("routed", "shared") and got.trainer.layers == (2, 3)
    assert got.rollout.rac.ratio == 0.5 and got.rollout.rac.selection == "dynamic"
    assert got.rollout.rac.metric == "amax"
    assert QuadsConfig.from_dict(got.to_dict()) == got
    assert got.trainer.wants_layer(2) and not got.trainer.wants_layer(1)


@pytest.mark.parametrize(
    "data,key",
    [
        ({"trainer": {"scale_mod": "row"}}, "trainer.scale_mod"),
        ({"trainer": {"scale_mode": "col"}}, "trainer.scale_mode"),
        ({"trainer": {"linears": ["fc3"]}}, "trainer.linears"),
        ({"trainer": {"layers": [0]}}, "trainer.layers"),
        ({"trainer": {"enabled": "yes"}}, "trainer.enabled"),
        ({"rollout": {"rac": {"ratio": 1.5}}}, "rollout.rac.ratio"),
        ({"rollout": {"rac": {"ratio": True}}}, "rollout.rac.ratio"),
        ({"rollout": {"rac": {"selection": "magic"}}}, "rollout.rac.selection"),
        ({"rollout": {"rac": {"colour": 1}}}, "rollout.rac.colour"),
        ({"rollout": {"activation_scale": "x"}}, "rollout.activation_scale"),
        ({"rollout": 3}, "rollout"),
        ({"bogus": 1}, "bogus"),
        ({"exclude": [1]}, "exclude"),
        ({"trainer": {"scale_mode": "row"}}, "trainer.scale_mode"),
        ({"rollout": {"rac": {"metric": "mse"}}}, "rollout.rac.metric"),
        ({"nvfp4": {"nvfp4_4over6": "weight"}}, "nvfp4.nvfp4_4over6"),
        ({"nvfp4": {"nvfp4_4over6_e4m3_use_256": True}}, "nvfp4.nvfp4_4over6_e4m3_use_256"),
        ({"nvfp4": {"nvfp4_4over6_err_mode": "rmse"}}, "nvfp4.nvfp4_4over6_err_mode"),
        ({"nvfp4": {"row_scaled_activation": "yes"}}, "nvfp4.row_scaled_activation"),
        ({"nvfp4": {"four_over_six": "all"}}, "nvfp4.four_over_six"),
        ({"nvfp4": ["all"]}, "nvfp4"),
    ],
)
def test_errors_name_the_key(data, key):
    with pytest.raises(QuadsConfigError, match="^" + re.escape(key) + r"\b"):
        QuadsConfig.from_dict(data)


def test_exclude_is_refused_with_what_to_use_instead():
    """A top-level exclude was accepted and ignored: now it is refused, naming the replacements."""
    with pytest.raises(QuadsConfigError, match=r"^exclude: .*trainer\.layers.*quads convert --exclude"):
        QuadsConfig.from_dict({"exclude": ["*.layers.0.*"]})
    with pytest.raises(QuadsConfigError, match="^exclude: "):
        QuadsConfig.from_dict({"exclude": []})  # even empty: the key does nothing
    assert "exclude" not in QuadsConfig().to_dict()


def test_row_scale_mode_is_refused():
    """Per-row weight scales would train weights that convert / live sync (per-tensor) never send."""
    with pytest.raises(QuadsConfigError, match=r"^trainer\.scale_mode: only 'tensor'.*per-tensor global scale"):
        QuadsConfig.from_dict({"trainer": {"scale_mode": "row"}})
    assert QuadsConfig.from_dict({"trainer": {"scale_mode": "tensor"}}).trainer.scale_mode == "tensor"


def test_missing_yaml_file_is_a_config_error(tmp_path):
    with pytest.raises(QuadsConfigError, match="cannot read the QUADS config"):
        load_config(tmp_path / "nope.yaml")


def test_example_yaml_is_valid_and_matches_the_defaults():
    """examples/quads.yaml documents the keys: it must load, and hold the documented defaults."""
    example = Path(__file__).resolve().parents[1] / "examples" / "quads.yaml"
    assert load_config(example) == QuadsConfig()


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("trainer: [unclosed\n")
    with pytest.raises(QuadsConfigError, match="not valid YAML"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(QuadsConfigError, match="top level must be a mapping"):
        load_config(p)


@pytest.mark.parametrize(
    "ratio,k,want",
    [(0, 2048, 0), (0.125, 2048, 256), (0.5, 768, 384), (0.01, 2048, 32), (1.0, 48, 48), (0.3, 48, 16)],
)
def test_rac_channel_count_is_16_aligned(ratio, k, want):
    assert RACConfig(ratio=ratio).num_channels(k) == want  # ceil(ratio*k) rounded up to 16, capped at k


@pytest.mark.parametrize(
    "scope,use_256,weights,activations",
    [
        ("none", "all", None, None),
        ("all", "all", 256, 256),
        ("weights", "all", 256, None),
        ("activations", "all", None, 256),
        ("all", "none", 448, 448),
        ("all", "weights", 256, 448),
        ("all", "activations", 448, 256),
        ("weights", "activations", 448, None),  # 256 only where both scopes cover the tensor
    ],
)
def test_nvfp4_section_maps_to_recipes_as_te_builds_quantizers(scope, use_256, weights, activations):
    """TE's NVFP4BlockScaling -> forward quantizers: nvfp4_4over6 picks the tensors that use 4over6,
    nvfp4_4over6_e4m3_use_256 those of them whose global scale maps to 256 (quantization.py, make_quantizers)."""
    cfg = load_config({"nvfp4": {"nvfp4_4over6": scope, "nvfp4_4over6_e4m3_use_256": use_256}}).nvfp4
    for recipe, want in ((cfg.weights, weights), (cfg.activations, activations)):
        if want is None:
            assert recipe == NVFP4Recipe()
        else:
            assert recipe == NVFP4Recipe(use_4over6=True, e4m3_max=want, err_mode="MAE")
    assert cfg.is_default == (weights is None and activations is None)
    assert QuadsConfig.from_dict(load_config({"nvfp4": cfg.to_dict()}).to_dict()).nvfp4 == cfg


def test_nvfp4_err_mode_reaches_the_recipes_and_is_upper_case():
    cfg = load_config({"nvfp4": {"nvfp4_4over6": "all", "nvfp4_4over6_err_mode": "mse"}}).nvfp4
    assert cfg.nvfp4_4over6_err_mode == "MSE" and cfg.weights.err_mode == cfg.activations.err_mode == "MSE"
    assert load_config({"nvfp4": {"nvfp4_4over6_err_mode": "MSE"}}).nvfp4.is_default  # no 4over6: no effect


def test_per_tensor_dynamic_activations_are_refused():
    """TE's default row_scaled_activation=False (one dynamic amax per activation tensor) is not served."""
    with pytest.raises(QuadsConfigError, match=r"^nvfp4\.row_scaled_activation: false .*per token"):
        QuadsConfig.from_dict({"nvfp4": {"row_scaled_activation": False}})
    assert QuadsConfig().nvfp4.row_scaled_activation is True


def test_nvfp4_recipe_validates_its_fields():
    assert NVFP4Recipe(True, 256, "mse").err_mode == "MSE"
    for bad, err in (
        (dict(e4m3_max=300), ValueError),
        (dict(e4m3_max=256), ValueError),  # 256 without 4over6 would change nothing: refused
        (dict(err_mode="MSE"), ValueError),
        (dict(use_4over6=True, err_mode="L1"), ValueError),
        (dict(use_4over6=1), TypeError),
        (dict(use_4over6=True, e4m3_max=True), ValueError),
    ):
        with pytest.raises(err):
            NVFP4Recipe(**bad)
