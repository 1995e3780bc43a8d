"""Disk and resident weight bytes of Qwen3.5-27B and -35B-A3B under each shipped recipe (shapes only).

Text model only (vision and MTP are optional components); bf16 checkpoint dtype assumed for
unquantized tensors. Run: ``python perf/quant_sizes.py`` (CPU is enough).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.quant.recipe import RecipeError, list_recipes, load_recipe
from ninfer.quant.sizes import REFERENCE_CONFIGS, recipe_bytes, text_weight_shapes

GIB = 2 ** 30


def main() -> None:
    print(f"{'model':9s} {'recipe':24s} {'params':>8s} {'quantized':>9s} {'disk GiB':>9s} {'resident GiB':>12s} "
          f"{'bits/param':>10s}")
    for model, config in REFERENCE_CONFIGS.items():
        shapes = text_weight_shapes(config)
        params = sum(_numel(s) for s in shapes.values())
        print(f"{model:9s} {'(bf16 checkpoint)':24s} {params / 1e9:7.2f}B {'-':>9s} {2 * params / GIB:9.2f} "
              f"{2 * params / GIB:12.2f} {16:10.2f}")
        for name, _ in list_recipes():
            try:
                b = recipe_bytes(load_recipe(name), shapes)
            except RecipeError:
                continue  # a recipe for the other model
            print(f"{model:9s} {name:24s} {b.params / 1e9:7.2f}B {100 * b.quantized_params / b.params:8.1f}% "
                  f"{b.disk / GIB:9.2f} {b.resident / GIB:12.2f} {8 * b.disk / b.params:10.2f}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
