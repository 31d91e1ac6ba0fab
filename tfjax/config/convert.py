"""ConfigDict (or dict, or JSON) <-> the frozen config dataclasses.

`from_dict` converts one section, coercing each value to its field's type; an
unknown key, a wrong type, or a field that moved (`model.num_experts` is now
`model.moe.num_experts`) raises `ValueError` naming the field. `model_config` and
`run_config` convert and validate; `moved_field` and `unknown_field` answer for a
dotted path (the command line asks them before applying `--config.<path>=`
overrides); `flat_fields` lists a config's fields by dotted path.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Mapping

import ml_collections

from tfjax.config.checks import fail
from tfjax.config.model import ModelConfig
from tfjax.config.run import RunConfig

__all__ = ["apply_variant", "default_config", "flat_fields", "from_dict", "model_config",
           "moved_field", "run_config", "to_config_dict", "unknown_field", "upgrade_saved"]


def _convert(field: str, tp: Any, value: Any) -> Any:
    """Coerce one value to a dataclass field type, or fail naming the field."""
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=field)
    origin = typing.get_origin(tp)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            fail(field, f"expected a tuple, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(f"{field}[{i}]", args[0], v) for i, v in enumerate(value))
        if len(value) != len(args):  # a fixed-length tuple, e.g. (step, weights)
            fail(field, f"expected {len(args)} items, got {value!r}")
        return tuple(_convert(f"{field}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if not isinstance(value, bool):
            fail(field, f"expected True or False, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            fail(field, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(field, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(field, f"expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type, values: Mapping[str, Any] | ml_collections.ConfigDict | None,
              prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys, moved fields and bad types
    name the field."""
    if values is None:
        return cls()
    if dataclasses.is_dataclass(values):
        return values
    if isinstance(values, ml_collections.ConfigDict):
        values = values.to_dict()
    if not isinstance(values, Mapping):
        fail(prefix or cls.__name__, f"expected a mapping of fields, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    moved = getattr(cls, "MOVED", {})
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else key
        if key in moved:
            raise ValueError(f"{name} moved to {prefix + '.' if prefix else ''}{moved[key]}")
        if key not in fields:
            close = [f for f in fields if f.startswith(key[:3])]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            fail(name, f"unknown field{hint}; fields of {cls.__name__}: {', '.join(sorted(fields))}")
        kwargs[key] = _convert(name, hints[key], value)
    return cls(**kwargs)


def moved_field(path: str, root: type = RunConfig) -> str | None:
    """The path a moved field has now (`"model.moe_d_ff"` -> `"model.moe.d_ff"`), or
    None when `path` is not one (it exists, or never did)."""
    parts = path.split(".")
    cls = root
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return None
        moved = getattr(cls, "MOVED", {})
        if part in moved:
            return ".".join(parts[:i] + [moved[part]] + parts[i + 1:])
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return None


def unknown_field(path: str, root: type = RunConfig) -> str | None:
    """Why dotted `path` names no field (`"model.num_layerz"` -> "model has no field
    'num_layerz' (did you mean 'num_layers'?)"), or None when it names one, names a
    moved one (`moved_field` answers those) or goes below a section into a value
    that is not a dataclass (a dict of rules, a tuple)."""
    parts = path.split(".")
    cls, where = root, []
    for part in parts:
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            if part in getattr(cls, "MOVED", {}):
                return None
            close = difflib.get_close_matches(part, [f.name for f in dataclasses.fields(cls)], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{'.'.join(where) or 'the config'} has no field {part!r}{hint}"
        cls = hints[part]
        where.append(part)
    return None


def upgrade_saved(values: Mapping[str, Any], root: type = RunConfig) -> dict:
    """A config that tfjax itself saved (a run's `config.json`), with every field
    that has since moved into a section put at its path now (`model.num_experts` ->
    `model.moe.num_experts`), so runs written before the move still load. Only for
    saved configs: a preset or an override that uses an old path still gets the
    error naming the new one (`from_dict`)."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(root)
    moved = getattr(root, "MOVED", {})
    for key, value in values.items():
        if key in moved:
            *sections, leaf = moved[key].split(".")
            node = out
            for section in sections:
                node = node.setdefault(section, {})
            node[leaf] = value
        elif dataclasses.is_dataclass(hints.get(key)) and isinstance(value, Mapping):
            section = upgrade_saved(value, hints[key])
            out[key] = {**section, **out.get(key, {})} if key in out else section
        else:
            out[key] = value
    return out


def model_config(cfg: Mapping[str, Any] | ml_collections.ConfigDict | ModelConfig) -> ModelConfig:
    """`cfg.model` (a ConfigDict or dict) -> a validated, frozen `ModelConfig`."""
    c = cfg if isinstance(cfg, ModelConfig) else from_dict(ModelConfig, cfg, prefix="model")
    return c.validate()


def run_config(cfg: Mapping[str, Any] | ml_collections.ConfigDict | RunConfig) -> RunConfig:
    """A whole preset (`get_config(...)`) -> a validated, frozen `RunConfig`."""
    c = cfg if isinstance(cfg, RunConfig) else from_dict(RunConfig, cfg)
    return c.validate()


def default_config() -> ml_collections.ConfigDict:
    """The defaults of every section as a ConfigDict; presets start here and override."""
    return to_config_dict(RunConfig())


def apply_variant(cfg: ml_collections.ConfigDict, arg: str | None,
                  variants: Mapping[str, Mapping[str, Any]]) -> ml_collections.ConfigDict:
    """Presets' `get_config(arg)`: apply the overrides of variant `arg` (None = the
    preset's default). Overrides are nested dicts, e.g. {"model": {"num_layers": 2}}."""
    if arg is None or arg == "":
        return cfg
    if arg not in variants:
        raise ValueError(f"unknown preset variant {arg!r}; allowed: {', '.join(sorted(variants))} "
                         "(or none for the full-size default)")

    def merge(node, overrides, where):
        for key, value in overrides.items():
            if key not in node:
                now = moved_field(f"{where}{key}")
                what = f"moved to {now}" if now else "is not a config field"
                raise ValueError(f"preset variant {arg!r}: {where}{key} {what}")
            if isinstance(value, Mapping):
                merge(node[key], value, f"{where}{key}.")
            else:
                node[key] = value

    merge(cfg, variants[arg], "")
    return cfg


def flat_fields(obj: Any, prefix: str = "") -> dict[str, Any]:
    """A config dataclass's fields by dotted path, sections opened (`{"attention.impl":
    "auto", "rope.theta": 10000.0, ...}`), in field order."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out.update(flat_fields(v, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = v
    return out


def to_config_dict(obj: Any) -> ml_collections.ConfigDict:
    """A dataclass -> ConfigDict (presets start from the defaults and override)."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return x

    return ml_collections.ConfigDict(plain(obj))
