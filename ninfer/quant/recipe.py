"""Quantization recipes: which weight format each parameter gets.

A recipe is a JSON file (``recipes/<name>.json``, or any path)::

    {"description": "one line for --list-recipes",
     "rules": [{"select": ["layers.*.mlp.gate_proj", "layers.*.mlp.up_proj"], "format": "int4-g64"},
               {"select": "*norm*", "format": "bf16"},
               {"select": "layers.*.mlp.experts.*", "format": "nvfp4", "optional": true}]}

Selectors are shell globs (``*`` also matches dots) over weight names: canonical parameter names
with ``.weight`` dropped (``embed_tokens``, ``lm_head``, ``layers.3.self_attn.q_proj``,
``layers.0.mlp.experts.gate_up_proj``, ``layers.0.linear_attn.A_log``); projections the model fuses
into one module are named by their checkpoint parts (``layers.0.mlp.gate_proj`` and ``up_proj``,
``self_attn.q_proj`` / ``k_proj`` / ``v_proj``, ``linear_attn.in_proj_a`` / ``in_proj_b``, ``mlp.gate``
and ``mlp.shared_expert_gate``), and the parts of one module must resolve to one format (loading and
``ninfer convert`` refuse a recipe that splits them, naming both). MTP weights carry an
``mtp.`` prefix, and only patterns that start with ``mtp.`` select them. The first rule that
matches a name decides its format; names no rule matches keep their checkpoint dtype. A selector
matching nothing is an error unless its rule is ``optional`` (generic recipes serving dense and
MoE models alike), and so are unknown formats and shapes a format cannot store.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from ninfer.quant.formats import FORMATS, FormatError, get_format

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


class RecipeError(ValueError):
    """A recipe that cannot be read or does not fit the model; the message names the rule and weight."""


@dataclass(frozen=True)
class Rule:
    select: tuple[str, ...]
    format: str
    optional: bool = False


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    rules: tuple[Rule, ...]
    path: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "path": str(self.path) if self.path else None,
                "rules": [{"select": list(r.select), "format": r.format, "optional": r.optional} for r in self.rules]}


def recipe_dirs() -> list[Path]:
    """Where recipe names are looked up: ``$NINFER_RECIPES`` (os.pathsep-separated), then the shipped ones."""
    extra = [Path(p) for p in os.environ.get("NINFER_RECIPES", "").split(os.pathsep) if p]
    return [*extra, RECIPES_DIR]


def parse_recipe(data: Any, name: str, path: Path | None = None) -> Recipe:
    where = f"recipe {name!r}" + (f" ({path})" if path else "")
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list) or not data["rules"]:
        raise RecipeError(f"{where}: expected an object with a non-empty \"rules\" list")
    rules = []
    for i, raw in enumerate(data["rules"]):
        if not isinstance(raw, dict) or "select" not in raw or "format" not in raw:
            raise RecipeError(f"{where}: rule {i} needs \"select\" and \"format\"")
        unknown = sorted(set(raw) - {"select", "format", "optional"})
        if unknown:
            raise RecipeError(f"{where}: rule {i} has unknown keys {unknown}")
        select = (raw["select"],) if isinstance(raw["select"], str) else tuple(raw["select"])
        if not select or not all(isinstance(s, str) and s for s in select):
            raise RecipeError(f"{where}: rule {i} \"select\" must be a glob or a list of globs")
        if raw["format"] not in FORMATS:
            raise RecipeError(f"{where}: rule {i} uses unknown format {raw['format']!r}; "
                              f"known formats: {', '.join(FORMATS)}")
        rules.append(Rule(select, raw["format"], bool(raw.get("optional", False))))
    return Recipe(name, str(data.get("description", "")), tuple(rules), path)


def load_recipe(name_or_path: str | os.PathLike[str]) -> Recipe:
    """A recipe by file path, or by name from :func:`recipe_dirs`."""
    path = Path(name_or_path)
    if not path.is_file():
        found = [d / f"{name_or_path}.json" for d in recipe_dirs() if (d / f"{name_or_path}.json").is_file()]
        if not found:
            known = ", ".join(name for name, _ in list_recipes()) or "none"
            raise RecipeError(f"no recipe file or name {str(name_or_path)!r}; shipped recipes: {known}")
        path = found[0]
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecipeError(f"cannot read recipe {path}: {err}") from None
    return parse_recipe(data, path.stem, path)


def list_recipes() -> list[tuple[str, str]]:
    """``(name, description)`` of every recipe found by name, first occurrence wins."""
    seen: dict[str, str] = {}
    for d in recipe_dirs():
        for path in sorted(d.glob("*.json")) if d.is_dir() else []:
            if path.stem not in seen:
                try:
                    seen[path.stem] = str(json.loads(path.read_text()).get("description", ""))
                except (OSError, json.JSONDecodeError, AttributeError):
                    seen[path.stem] = "(unreadable)"
    return sorted(seen.items())


def resolve_plan(recipe: Recipe, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """``weight name -> format`` for every name some rule selects (first matching rule wins), checked
    against the weights' shapes."""
    plan: dict[str, str] = {}
    for i, rule in enumerate(recipe.rules):
        for pattern in rule.select:
            matches = [name for name in shapes if fnmatchcase(name, pattern)
                       and (pattern.startswith("mtp.") or not name.startswith("mtp."))]
            if not matches and not rule.optional:
                raise RecipeError(f"recipe {recipe.name!r}: rule {i} selector {pattern!r} matches no weight of this "
                                  f"model (weights look like {_examples(shapes)}); fix it or mark the rule optional")
            for name in matches:
                plan.setdefault(name, rule.format)
    for name, fmt in plan.items():
        if fmt == "bf16":
            continue
        try:
            get_format(fmt).check_shape(shapes[name])
        except FormatError as err:
            raise RecipeError(f"recipe {recipe.name!r}: weight {name} {list(shapes[name])}: {err}") from None
    return plan


def split_plan(plan: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(text, mtp)``: a plan resolved over a model and its MTP head (``mtp.``-prefixed names) as the plans of
    each module (the head's names without the prefix)."""
    text = {name: fmt for name, fmt in plan.items() if not name.startswith("mtp.")}
    return text, {name.removeprefix("mtp."): fmt for name, fmt in plan.items() if name.startswith("mtp.")}


def _examples(shapes: dict[str, tuple[int, ...]]) -> str:
    names = list(shapes)
    picks = [n for n in names if n.startswith("layers.0.")][:3] + [n for n in names if not n.startswith("layers.")][:2]
    return ", ".join(picks or names[:5])
