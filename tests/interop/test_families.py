"""The family table: every module of `tfjax.interop.families` is in `hf.FAMILIES`
under each `model_type` its record names, no `model_type` twice, and nothing else
(a family module left out of the table, or two records claiming one name, fails
here). Nothing here builds a model."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from tfjax.interop import families, hf


def _modules():
    return [importlib.import_module(f"tfjax.interop.families.{m.name}")
            for m in pkgutil.iter_modules(families.__path__)]


def test_every_family_module_is_in_the_table_under_each_of_its_model_types():
    names = []
    for module in _modules():
        family = module.FAMILY
        assert isinstance(family, hf.Family), module.__name__
        for model_type in family.model_types:
            assert hf.FAMILIES.get(model_type) is family, (module.__name__, model_type)
        names += family.model_types
    assert sorted(names) == list(hf.FAMILIES.names())  # each name once, none from elsewhere


def test_the_table_is_fixed_where_it_is_defined():
    with pytest.raises(TypeError, match="fixed where it is defined"):
        hf.FAMILIES.register("helium", hf.FAMILIES.get("llama"))
