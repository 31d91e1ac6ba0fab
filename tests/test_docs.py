"""The how-to pages of docs/ run as written: each page's python blocks, executed in
order in one namespace (from a scratch directory, the repository root importable for
`configs`), as tests/test_readme.py does for the README.

A block whose first line is a file's path as a comment (`# tfjax/ops/query_chunks.py`,
`# tfjax/models/layer_kinds.py, beside ...`) is code of that file:

- a file that does not exist yet runs as that new module, importable by its dotted
  name (`from tfjax.ops import query_chunks`, `from tfjax.interop.families import
  helium`) by the blocks after it;
- an excerpt of an existing module runs among a copy of that module's globals, and
  each name it binds anew replaces the module's (`IMPLEMENTATIONS` and `AUTO_ORDER`
  in `tfjax.ops.attention`, `FAMILIES` in `tfjax.interop.hf`), as an edit of the file
  would.

Everything such a block changes is undone after the test: module attributes and
`sys.modules` through monkeypatch, and the registries (the layer-kind, ffn-kind and
checkpoint-family tables) are copies for the test's duration.

The pages' tables of a record's fields (a header "| `Record` field | ..."; which
record each is: `RECORD_TABLES`) list exactly the record's fields.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re
import sys
import types

import pytest

from tfjax import models
from tfjax.config import model_config
from tfjax.interop import hf
from tfjax.models import FFN_KINDS, LAYER_KINDS
from tfjax.train import __main__ as train_cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = ["howto/attention_implementation.md", "howto/layer_kind.md", "howto/preset.md",
         "howto/checkpoint_family.md", "presets.md", "interp.md"]
FILE_COMMENT = re.compile(r"#\s+((?:tfjax|configs)/[\w/]+\.py)\b")


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python fence; other fences (directives
    such as ```{literalinclude}, text, bash) are skipped whole."""
    blocks, fence, start, body = [], None, 0, []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if fence is None:
            m = re.match(r"^(`{3,}|~{3,})(.*)$", line)
            if m:
                fence, info, start, body = m.group(1), m.group(2).strip(), n + 1, []
        elif line.strip() == fence:
            if info == "python":
                blocks.append((start, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page}: a fence opened at line {start - 1} is never closed"
    return blocks


def _module_name(path: str) -> str:
    return path[:-len(".py")].replace("/", ".")


def _run_as_file(path: str, code: str, label: str, monkeypatch) -> None:
    name = _module_name(path)
    parent_name, _, leaf = name.rpartition(".")
    compiled = compile(code, label, "exec")
    if (ROOT / path).exists():  # an excerpt: among the module's globals, then an edit
        module = importlib.import_module(name)
        namespace = dict(vars(module))
        exec(compiled, namespace)
        for key, value in namespace.items():
            if key == "__builtins__":
                continue
            if key not in vars(module) or vars(module)[key] is not value:
                monkeypatch.setattr(module, key, value, raising=False)
        return
    module = types.ModuleType(name)  # a new file: a new module
    module.__file__ = str(ROOT / path)
    exec(compiled, module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(importlib.import_module(parent_name), leaf, module, raising=False)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A scratch directory, the repository importable, the registries copied."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    for registry in (LAYER_KINDS, FFN_KINDS, hf.FAMILIES):
        monkeypatch.setattr(registry, "_items", dict(registry._items))
    return monkeypatch


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, scratch):
    blocks = python_blocks(DOCS / page)
    assert blocks, f"docs/{page} lost its python blocks"
    namespace: dict = {"__name__": "docs"}
    for line, code in blocks:
        label = f"docs/{page}:{line}"
        first = code.split("\n", 1)[0]
        file = FILE_COMMENT.match(first)
        try:
            if file:
                _run_as_file(file.group(1), code, label, scratch)
            else:
                exec(compile(code, label, "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - say which block broke
            raise AssertionError(f"the python block at {label} fails: {e!r}\n{code}") from e


def test_fences_are_parsed_as_the_docs_build_reads_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\na = 1\n```\n```{literalinclude} x.py\n:lines: 1\n```\n"
                    "````python\nb = '```'\n````\n```bash\nmake\n```\n")
    assert python_blocks(page) == [(3, "a = 1\n"), (9, "b = '```'\n")]


def _error(f, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        f(*args, **kwargs)
    return str(e.value)


def test_the_presets_page_quotes_the_real_errors(capsys):
    """docs/presets.md lists what a wrong config prints; each line is what tfjax says."""
    page = (DOCS / "presets.md").read_text()
    build = lambda **fields: models.build(fields)  # noqa: E731
    said = [
        _error(model_config, dict(num_heads=8, num_kv_heads=3)),
        _error(model_config, dict(num_layer=2)).split(" fields of ModelConfig: ")[0],
        _error(model_config, dict(num_experts=8)),
        _error(build, norm="rms"),
        _error(build, layer_pattern=("global", "locl")),
        _error(build, attention=dict(impl="flash")),
        _error(build, arch="encoder", layer_pattern=("mamba",), ffn_pattern=("none",)),
    ]
    with pytest.raises(SystemExit) as stop:
        train_cli.parse_flags(["tfjax.train", "--config.model.num_experts=8"])
    assert stop.value.code == 2
    said.append(capsys.readouterr().err.strip())
    for line in said:
        assert line in page, f"docs/presets.md does not quote what tfjax says: {line}"


# page -> {the record a "| `Record` field | ..." table of the page documents: its class}
RECORD_TABLES = {
    "howto/attention_implementation.md": {
        "Implementation": "tfjax.ops.implementation.Implementation"},
    "howto/layer_kind.md": {"LayerKind": "tfjax.models.layer_kinds.LayerKind",
                            "FfnKind": "tfjax.models.layer_kinds.FfnKind"},
    "howto/checkpoint_family.md": {"Family": "tfjax.interop.hf.Family"},
}
FIELD_TABLE = re.compile(r"^\|\s*`(\w+)` field\s*\|")


def field_tables(page: pathlib.Path) -> dict[str, list[str]]:
    """record name -> the fields its "| `Record` field | ..." table in `page` lists
    (each row's first cell, its leading name: `relative_bias=True` -> relative_bias)."""
    tables, rows = {}, None
    for line in page.read_text().splitlines():
        header = FIELD_TABLE.match(line)
        if header:
            assert header.group(1) not in tables, f"{page}: two tables of {header.group(1)}"
            rows = tables[header.group(1)] = []
        elif rows is not None and line.startswith("|"):
            cell = line.split("|")[1].strip()
            if not set(cell) <= set("-: "):  # the separator row
                rows.append(re.match(r"`?(\w+)", cell).group(1))
        else:
            rows = None
    return tables


def _record(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_record_table_is_declared():
    found = {str(p.relative_to(DOCS)): sorted(t) for p in sorted(DOCS.rglob("*.md"))
             if (t := field_tables(p))}
    assert found == {page: sorted(t) for page, t in RECORD_TABLES.items()}, \
        "the pages' record tables and RECORD_TABLES differ (declare a new table there)"


@pytest.mark.parametrize("page", sorted(RECORD_TABLES))
def test_record_tables_list_exactly_the_records_fields(page):
    tables = field_tables(DOCS / page)
    bad = []
    for name, path in RECORD_TABLES[page].items():
        documented, fields = tables.get(name, []), [f.name for f in
                                                    dataclasses.fields(_record(path))]
        extra = [f for f in documented if f not in fields]
        missing = [f for f in fields if f not in documented]
        twice = sorted({f for f in documented if documented.count(f) > 1})
        if extra or missing or twice:
            bad.append(f"docs/{page}, the {name} table ({path}): not fields: {extra}; "
                       f"fields not listed: {missing}; listed twice: {twice}")
    assert not bad, "\n".join(bad)
