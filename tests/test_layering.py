"""The package's shape, checked from its source: dependencies point down, there is
no import circle, tfjax imports sit at the top of their module, no file grows
past ~600 lines unless it is one kernel, docs/design.md's module map names every
module, and module docstrings are short.

Layers (a module may import its own layer and those below it):

    0  tfjax.typing, tfjax.registry, tfjax.storage,    names, registries, the file layer,
       tfjax.config                                     config
    1  tfjax.ops                                        attention op, masks, kernels
    2  tfjax.parallel                                   mesh, rules, ring, per-device
    3  tfjax.nn                                         layers
    4  tfjax.inference                                  caches, sampling, decode loop
    5  tfjax.models                                     architectures, layer kinds
    6  tfjax.data, tfjax.train, tfjax.interop,          the programs built on models
       tfjax.interp, tfjax.generate, tfjax.export
    7  tfjax.eval, tfjax.serve                          scoring and serving what level 6
                                                        trains and loads
    8  tfjax.*.__main__                                 command lines (`python -m tfjax.train`),
                                                        which nothing imports

Only module-level imports count for layers and circles (a function-local tfjax
import is reported on its own: it is where circles hide). An import by name with a
string literal (`importlib.import_module("tfjax.x")`, `__import__`) counts as an
import statement at the same place.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tfjax"
LAYERS = (
    ("tfjax.typing", "tfjax.registry", "tfjax.storage", "tfjax.config"),
    ("tfjax.ops",),
    ("tfjax.parallel",),
    ("tfjax.nn",),
    ("tfjax.inference",),
    ("tfjax.models",),
    ("tfjax.data", "tfjax.train", "tfjax.interop", "tfjax.interp", "tfjax.generate",
     "tfjax.export"),
    ("tfjax.eval", "tfjax.serve"),
)
COMMAND_LINES = len(LAYERS)  # every `__main__` module: the top layer
# Files allowed past MAX_LINES: each is one kernel (its forward and backward
# passes), where splitting would separate code that is read together.
MAX_LINES = 600
ONE_KERNEL: frozenset[str] = frozenset({
    "ops/pallas/mosaic_tpu.py",
    "ops/pallas/triton.py",
    "ops/pallas/mosaic_gpu.py",
})
# Function-local tfjax imports that an optional dependency needs (none today).
LOCAL_IMPORTS_ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, modules) -> str | None:
    """The tfjax module an imported name lives in (`tfjax.ops.masks.causal` ->
    `tfjax.ops.masks`), or None for other packages."""
    if name != "tfjax" and not name.startswith("tfjax."):
        return None
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_by_call(call: ast.Call) -> str | None:
    """The module a call imports by name, when it names it as a string literal:
    `importlib.import_module("tfjax.x")`, `import_module("tfjax.x")`,
    `__import__("tfjax.x")`."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _imports(path: pathlib.Path, module: str, modules):
    """(module-level tfjax imports, function-local tfjax imports as (module, line))."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top, local = set(), []

    def targets(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        return [f"{base}.{a.name}" if base else a.name for a in node.names] + [base]

    def visit(node, in_function, in_type_checking):
        for child in ast.iter_child_nodes(node):
            names = None
            if isinstance(child, (ast.Import, ast.ImportFrom)) and not in_type_checking:
                names = targets(child)
            elif isinstance(child, ast.Call) and (name := _imported_by_call(child)):
                names = [name]
            if names is not None:
                found = {m for t in names if (m := _resolve(t, modules))}
                found.discard(module)
                if in_function:
                    local.extend((m, child.lineno) for m in sorted(found))
                else:
                    top.update(found)
            tc = in_type_checking or (isinstance(child, ast.If)
                                      and "TYPE_CHECKING" in ast.unparse(child.test))
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            visit(child, fn, tc)

    visit(tree, False, False)
    return top, local


def _graph():
    modules = _modules()
    edges, local = {}, {}
    for name, path in modules.items():
        edges[name], local[name] = _imports(path, name, modules)
    return modules, edges, local


def _layer(module: str) -> int | None:
    if module.endswith(".__main__"):
        return COMMAND_LINES
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def test_dependencies_point_down():
    _, edges, _ = _graph()
    bad = []
    for src, dsts in edges.items():
        ls = _layer(src)
        if ls is None:  # tfjax/__init__.py: the curated public API imports any layer
            continue
        for dst in sorted(dsts):
            ld = _layer(dst)
            if ld is not None and ld > ls:
                bad.append(f"{src} (layer {ls}) imports {dst} (layer {ld})")
    assert not bad, "imports that point up:\n  " + "\n  ".join(bad)


def test_no_import_circles():
    _, edges, _ = _graph()
    # An import of a package runs its __init__: a module importing tfjax.ops.masks
    # also depends on tfjax.ops (and tfjax).
    def deps(m):
        out = set()
        for d in edges.get(m, ()):
            out.add(d)
            parts = d.split(".")
            out.update(".".join(parts[:i]) for i in range(2, len(parts)))
        out.discard(m)
        # a package's __init__ importing its own submodules is not a circle through it
        return {d for d in out if not m.startswith(d + ".")}

    cycles, state, stack = [], {}, []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(deps(m)):
            if d not in edges:
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)
    assert not cycles, "import circles:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_tfjax_imports_are_at_the_top_of_their_module():
    _, _, local = _graph()
    bad = [f"{src}:{line} imports {dst} inside a function"
           for src, found in local.items() for dst, line in found
           if (src, dst) not in LOCAL_IMPORTS_ALLOWED]
    assert not bad, "function-local tfjax imports:\n  " + "\n  ".join(bad)


def test_no_file_over_the_line_budget_unless_it_is_one_kernel():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in ONE_KERNEL:
            long.append(f"tfjax/{rel}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines:\n  " + "\n  ".join(long)


# --------------------------------------------------------------------------- #
# docs/design.md's module map ("### The modules") names every module.
# --------------------------------------------------------------------------- #

DESIGN = ROOT.parent / "docs" / "design.md"
_FILE = re.compile(r"(?<![\w./-])((?:\w+/)*\w+\.py)\b")
_DOTTED = re.compile(r"\btfjax(?:\.\w+)+")


def _module_map() -> str:
    """The ```text block under "### The modules" in docs/design.md."""
    text = DESIGN.read_text()
    section = text.split("### The modules", 1)[1]
    return section.split("```text\n", 1)[1].split("\n```", 1)[0]


def _map_entries(block: str) -> tuple[set[str], set[str]]:
    """(paths the map names, relative to the repository: `tfjax/ops/masks.py`, a
    package's `__init__.py` for its `dir/` line; the dotted tfjax names it mentions).

    The map is a tree: a line opening with `name/` is a directory, inside the nearest
    directory line above it that is indented less; `x.py` anywhere on a line is a
    file of the directory the line belongs to (a continuation line, indented deeper
    than every directory, belongs to the last one), `a/x.py` relative to it."""
    paths, dotted, stack = set(), set(), []  # stack: (indent, directory path)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        here = stack[-1][1] if stack else ""
        first = line.split()[0]
        rest = line
        if first.endswith("/"):
            here = f"{here}{first}"
            stack.append((indent, here))
            paths.add(f"{here}__init__.py")
            rest = line.replace(first, "", 1)
        paths.update(f"{here}{name}" for name in _FILE.findall(rest))
        dotted.update(_DOTTED.findall(line))
    return paths, dotted


def test_every_module_is_in_the_design_map():
    """Both directions, so that the map can be resynced from the message alone: the
    modules the map does not name, and the map's entries that name no module."""
    paths, dotted = _map_entries(_module_map())
    files = {p.relative_to(ROOT.parent).as_posix() for p in ROOT.rglob("*.py")}
    named = paths | {f"{d.replace('.', '/')}.py" for d in dotted} | \
        {f"{d.replace('.', '/')}/__init__.py" for d in dotted}
    missing = sorted(files - named)
    stale = sorted(paths - files)
    message = []
    if missing:
        message.append("modules missing from docs/design.md's module map (### The modules):\n  "
                       + "\n  ".join(missing))
    if stale:
        message.append("map entries that name no module:\n  " + "\n  ".join(stale))
    assert not message, "\n".join(message)


# --------------------------------------------------------------------------- #
# Short module docstrings: what a module computes, its contract and a link to its
# docs page; the page holds the essay.
# --------------------------------------------------------------------------- #

MAX_DOCSTRING_LINES = 12  # about ten lines of text, with the opening and closing quotes


def test_module_docstrings_are_short():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        first = tree.body[0] if tree.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                isinstance(first.value.value, str):
            n = first.end_lineno - first.lineno + 1
            if n > MAX_DOCSTRING_LINES:
                long.append(f"tfjax/{path.relative_to(ROOT).as_posix()}: {n} lines")
    assert not long, (f"module docstrings over {MAX_DOCSTRING_LINES} lines (quotes "
                      f"included):\n  " + "\n  ".join(long))


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (no packages under tests/): two files
    of one name in different folders break collection of the whole suite."""
    tests = pathlib.Path(__file__).parent
    seen = {}
    for path in sorted(tests.rglob("*.py")):
        if path.name == "conftest.py" or path.name == "__init__.py":
            continue
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename so each test file has its own basename: {clashes}"
