"""Engine options as users set them: the ``ninfer.load`` keywords and the ``--flags`` of the commands.

Each :class:`Option` lives in the metadata of the :class:`~ninfer.runtime.engine_config.EngineConfig`
field it sets and carries its default (in the user's unit: GiB, not bytes), its help text, its check
and its conversion to the field's value. ``ninfer.load`` and every command read the options from there,
so there is one set of defaults and one validator; an error names the option the way the caller spelt
it (``max_context`` for Python, ``--max-context`` on the command line).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30


class OptionError(ValueError):
    """A bad engine option; the message starts with the option's name as the caller gave it."""


@dataclass(frozen=True)
class Option:
    """One user-facing engine option.

    ``kind`` is the Python type of the value (``bool`` options are switches); ``literals`` are other
    values accepted as they are (``"auto"``); ``check`` returns what is wrong with a value ("must be
    >= 1") or None; ``to_field`` turns the value into the field's (GiB -> bytes); ``needs`` names an
    option that must be set for this one to mean anything. The command-line spelling is ``flag``
    (switches that default to on are ``--no-...``, described by ``flag_help``).
    """

    name: str
    default: Any
    help: str
    kind: type = int
    check: Callable[[Any], str | None] | None = None
    choices: tuple[Any, ...] | None = None
    literals: tuple[Any, ...] = ()
    to_field: Callable[[Any], Any] | None = None
    needs: str | None = None
    metavar: str | None = None
    flag_help: str | None = None  # what the flag does, where that is not ``help`` (``--no-...`` switches)

    @property
    def flag(self) -> str:
        if self.kind is bool and self.default:
            return "--no-" + self.name.replace("_", "-")
        return "--" + self.name.replace("_", "-")

    def validate(self, value: Any, label: str) -> Any:
        """``value`` if it is valid (ints are accepted for floats), else :class:`OptionError` naming ``label``."""
        if value in self.literals:
            return value
        if self.choices is not None:
            if value not in self.choices:
                shown = ", ".join(repr(c) for c in self.choices)
                raise OptionError(f"{label} must be one of {shown}, got {value!r}")
            return value
        ok_type = isinstance(value, self.kind) and (self.kind is bool or not isinstance(value, bool))
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok_type = float(value), True
        if not ok_type:
            raise OptionError(f"{label} must be {_kind_name(self)}, got {value!r}")
        problem = self.check(value) if self.check is not None else None
        if problem:
            raise OptionError(f"{label} {problem}, got {value!r}")
        return value

    def field_value(self, value: Any) -> Any:
        return self.to_field(value) if self.to_field is not None else value


def _kind_name(opt: Option) -> str:
    name = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}[opt.kind]
    names = [name, *(repr(v) for v in opt.literals)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def at_least(lo: float) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, float) and not math.isfinite(v):
            return "must be finite"
        return None if v >= lo else f"must be >= {lo}"
    return check


def between(lo: int, hi: int) -> Callable[[Any], str | None]:
    return lambda v: None if lo <= v <= hi else f"must be {lo}-{hi}"


def gib_to_bytes(gib: float) -> int:
    return int(gib * GIB)


def option(opt: Option, field_default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field set by ``opt``; its default is ``opt``'s default in the field's unit."""
    default = opt.field_value(opt.default) if field_default is dataclasses.MISSING else field_default
    return dataclasses.field(default=default, metadata={"options": (opt,)})


def options_of(cls: type) -> list[Option]:
    """Every option of a dataclass whose fields carry :func:`option` metadata, in field order."""
    return [opt for f in dataclasses.fields(cls) for opt in f.metadata.get("options", ())]


def resolve(cls: type, given: Mapping[str, Any], label: Callable[[Option], str], caller: str) -> dict[str, Any]:
    """The field values of ``cls`` that ``given`` (option name -> value) sets; every option not given takes
    its default. Unknown names, bad values and options given without the option they need are refused."""
    options = {opt.name: opt for opt in options_of(cls)}
    unknown = sorted(set(given) - set(options))
    if unknown:
        close = difflib.get_close_matches(unknown[0], options, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{caller} got an unexpected keyword argument {unknown[0]!r}{hint}")
    values = {name: opt.default for name, opt in options.items()}
    for name, value in given.items():
        values[name] = options[name].validate(value, label(options[name]))
    for name in given:
        needed = options[name].needs
        if needed is None or values[needed] not in (None, False):
            continue
        other = options[needed]
        if other.kind is bool:  # a switch turned off: name it the way it was turned off
            off = label(other) if label(other) != other.name else f"{other.name}=False"
            raise OptionError(f"{label(options[name])} conflicts with {off}")
        raise OptionError(f"{label(options[name])} needs {label(other)}")
    fields = {}
    for f in dataclasses.fields(cls):
        opts = f.metadata.get("options", ())
        if "resolve" in f.metadata:
            fields[f.name] = f.metadata["resolve"](values)
        elif opts:
            fields[f.name] = opts[0].field_value(values[opts[0].name])
    return fields
