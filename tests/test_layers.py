"""Every import in distmk/ points down or sideways: read from the source with ast (imports inside functions count,
nothing is imported), each module is placed in a layer of LAYERS and may import only from its own layer and those
below it."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "distmk"

LAYERS = [
    ("utilities", ("distmk", "distmk.errors", "distmk.timing", "distmk.flags")),
    ("models", ("distmk.models",)),
    ("device code", ("distmk.device",)),
    ("ranks", ("distmk.comm", "distmk.dist")),
    ("task types", ("distmk.tasks",)),
    ("graph", ("distmk.graph",)),
    ("reference", ("distmk.reference",)),
    ("kernels", ("distmk.kernels",)),
    ("runtime", ("distmk.runtime",)),
    ("engine flags", ("distmk.cli",)),
    ("programs", ("distmk.generate", "distmk.serve")),
]
"""Lowest first: distmk/README.md's data path, on the device code and rank transport that task types are built on."""


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> tuple[int, str]:
    """(index in LAYERS, prefix) of the longest prefix that holds `name`: a module is in its package's layer."""
    return max(((i, p) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if name == p or name.startswith(p + ".")), key=lambda ip: len(ip[1]))


def imports(name: str, source: str, modules: set[str], is_package: bool = False):
    """(line, imported module) of every distmk import in `source`, at any depth; `from a import b` is a.b where
    that is a module."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "distmk")
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module
            if base.split(".")[0] == "distmk":
                yield from ((node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
                            for a in node.names)


def upward_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """'module -> imported module' for each import of a higher layer; sources: module -> (source, is_package)."""
    found = []
    for name, (source, is_package) in sorted(sources.items()):
        for line, target in sorted(set(imports(name, source, set(sources), is_package))):
            if layer_of(target)[0] > layer_of(name)[0]:
                found.append(f"{name} -> {target}  (line {line}, layer {LAYERS[layer_of(name)[0]][0]} -> "
                             f"{LAYERS[layer_of(target)[0]][0]})")
    return found


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def test_imports_point_down():
    sources = package_sources()
    assert len(sources) > 50
    upward = upward_imports(sources)
    assert not upward, "imports of a higher layer (tests/test_layers.py LAYERS):\n" + "\n".join(upward)


def test_every_module_is_named_by_a_layer():
    """Only the package's own __init__ is placed by the bare `distmk` prefix: a new module is given a layer."""
    unplaced = [name for name in package_sources() if name != "distmk" and layer_of(name)[1] == "distmk"]
    assert not unplaced, f"modules without a layer in tests/test_layers.py LAYERS: {unplaced}"


def test_an_import_inside_a_function_is_found():
    sources = {"distmk.graph.x": ("def f():\n    from distmk import cli\n", False), "distmk.cli": ("", False),
               "distmk.graph": ("from . import x\nfrom .x import f\n", True), "distmk.errors": ("", False)}
    assert upward_imports(sources) == ["distmk.graph.x -> distmk.cli  (line 2, layer graph -> engine flags)"]
