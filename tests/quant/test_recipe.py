"""Recipes: shipped files, resolution against real model geometries, and clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer.quant.recipe import (
    RecipeError,
    list_recipes,
    load_recipe,
    parse_recipe,
    resolve_plan,
)
from ninfer.quant.sizes import REFERENCE_CONFIGS, recipe_bytes, text_weight_shapes

SHIPPED = {"int4", "nvfp4", "int8", "fp8", "qwen3_5_27b_int4", "qwen3_5_27b_nvfp4", "qwen3_5_35b_a3b_int4",
           "qwen3_5_35b_a3b_nvfp4"}


@pytest.fixture(scope="module")
def shapes() -> dict[str, dict[str, tuple[int, ...]]]:
    return {name: text_weight_shapes(cfg) for name, cfg in REFERENCE_CONFIGS.items()}


def test_shipped_recipes_are_listed_with_descriptions() -> None:
    listed = dict(list_recipes())
    assert SHIPPED <= set(listed)
    assert all(listed[name] for name in SHIPPED)


@pytest.mark.parametrize("model,recipe", [("27B", "qwen3_5_27b_int4"), ("27B", "qwen3_5_27b_nvfp4"),
                                          ("35B-A3B", "qwen3_5_35b_a3b_int4"), ("35B-A3B", "qwen3_5_35b_a3b_nvfp4"),
                                          ("27B", "int4"), ("35B-A3B", "int4"), ("27B", "nvfp4"),
                                          ("35B-A3B", "fp8"), ("27B", "int8")])
def test_recipes_cover_every_projection(shapes, model: str, recipe: str) -> None:
    plan = resolve_plan(load_recipe(recipe), shapes[model])
    for name in shapes[model]:
        kept = ("norm" in name or name.endswith(("conv1d", "A_log", "dt_bias", "in_proj_a", "in_proj_b", "mlp.gate",
                                                 "shared_expert_gate")))
        assert (plan.get(name, "bf16") == "bf16") == kept, (name, plan.get(name))
    sizes = recipe_bytes(load_recipe(recipe), shapes[model])
    assert sizes.disk < 0.7 * 2 * sizes.params  # every recipe at least ~halves the bf16 size


def test_model_specific_selectors_fail_on_the_other_model(shapes) -> None:
    with pytest.raises(RecipeError, match=r"qwen3_5_35b_a3b_nvfp4.*selector 'layers\.\*\.mlp\..*' matches no weight"):
        resolve_plan(load_recipe("qwen3_5_35b_a3b_nvfp4"), shapes["27B"])
    with pytest.raises(RecipeError, match="matches no weight"):
        resolve_plan(load_recipe("qwen3_5_27b_int4"), shapes["35B-A3B"])


def test_first_matching_rule_wins_and_optional_rules() -> None:
    shapes = {"layers.0.mlp.down_proj": (64, 128), "layers.0.mlp.up_proj": (128, 64), "norm": (64,)}
    recipe = parse_recipe({"rules": [{"select": "layers.*.mlp.down_proj", "format": "int8-g32"},
                                     {"select": "layers.*", "format": "nvfp4"},
                                     {"select": "layers.*.experts.*", "format": "int4-g64", "optional": True}]}, "t")
    assert resolve_plan(recipe, shapes) == {"layers.0.mlp.down_proj": "int8-g32", "layers.0.mlp.up_proj": "nvfp4"}


def test_errors_name_the_rule_and_the_weight() -> None:
    with pytest.raises(RecipeError, match="unknown format 'int3'.*int4-g64"):
        parse_recipe({"rules": [{"select": "x", "format": "int3"}]}, "bad")
    with pytest.raises(RecipeError, match="unknown keys"):
        parse_recipe({"rules": [{"select": "x", "format": "fp8", "formta": 1}]}, "bad")
    with pytest.raises(RecipeError, match="non-empty"):
        parse_recipe({"rules": []}, "bad")
    recipe = parse_recipe({"rules": [{"select": "*", "format": "int4-g128"}]}, "g128")
    with pytest.raises(RecipeError, match=r"layers\.0\.mlp\.up_proj \[128, 64\].*group size 128"):
        resolve_plan(recipe, {"layers.0.mlp.up_proj": (128, 64)})
    with pytest.raises(RecipeError, match=r"norm \[64\].*-D shape"):
        resolve_plan(parse_recipe({"rules": [{"select": "norm", "format": "fp8"}]}, "n"), {"norm": (64,)})
    with pytest.raises(RecipeError, match="no recipe file or name 'nope'.*qwen3_5_27b_int4"):
        load_recipe("nope")


def test_recipe_by_path_and_extra_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"description": "mine", "rules": [{"select": "*", "format": "fp8"}]}))
    assert load_recipe(path).name == "mine" and load_recipe(str(path)).rules[0].format == "fp8"
    monkeypatch.setenv("NINFER_RECIPES", str(tmp_path))
    assert load_recipe("mine").path == path
    assert ("mine", "mine") in list_recipes()
