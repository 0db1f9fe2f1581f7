"""The package's layering, checked on its source: every import, deferred ones inside functions included.

    core      config, config_router, gate_registry, topology, parallel, notices, stats, cpu_alloc, launch, progress,
              gates/, dispatch/, experts/, layer, models/, data/
    features  placement/, dynamic/, inference/, perfmodel/, gate_sync
    adapters  megatron_adapter/, fairseq_adapter/, train, train_checkpoint, cluster/
    tools     cli, trace_cli, bench/, reproduce/, results/

A module may import its own layer and the layers below it, never a layer above; no import cycle between modules;
the dispatch core imports no feature (features plug into it, dispatch/features.py); the config imports no gate."""
import ast
import os

import pytest

PKG = "megamoe_plugin"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)
LAYERS = {
    "core": ["config", "config_router", "gate_registry", "topology", "parallel", "notices", "stats", "cpu_alloc",
             "gates", "dispatch", "experts", "layer", "models", "data", "launch", "progress", "__init__"],
    "features": ["placement", "dynamic", "inference", "perfmodel", "gate_sync"],
    "adapters": ["megatron_adapter", "fairseq_adapter", "train", "train_checkpoint", "cluster"],
    "tools": ["cli", "trace_cli", "bench", "reproduce", "results"],
}
ORDER = list(LAYERS)


def _modules(root=ROOT):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _modules()


def _imports(module, path, modules=None, pkg=PKG, load_order=False):
    """Project modules imported anywhere in the file (top level, functions, classes, try blocks). ``from . import
    x`` counts as importing the package too: it reads the package's namespace, which its __init__ fills.

    ``load_order``: what Python runs when the module is loaded, for the cycle check: importing ``a.b.m`` from
    outside package ``a.b`` runs ``a.b``'s __init__ first (an edge to it), and a function-local import whose line
    says why in a comment (the sanctioned way to break a load-order cycle) is not run at load time (no edge)."""
    modules = MODULES if modules is None else modules
    is_pkg = path.endswith("__init__.py")
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    with open(path) as f:
        src = f.read()
    tree, lines = ast.parse(src, path), src.split("\n")
    deferred = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[:len(base) - node.level + 1]
                prefix = ".".join(parent + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
        else:
            continue
        if load_order and id(node) in deferred and "#" in lines[node.lineno - 1]:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if not (name == pkg or name.startswith(pkg + ".")) or name == module:
                continue
            found.add(name)
            if load_order:
                # the packages around the imported module that this module is not already inside
                parts = name.split(".")
                for i in range(1, len(parts)):
                    ancestor = ".".join(parts[:i])
                    if ancestor in modules and not (module == ancestor or module.startswith(ancestor + ".")):
                        found.add(ancestor)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}
LOAD_ORDER = {m: _imports(m, p, load_order=True) for m, p in MODULES.items()}


def _layer(module):
    top = module.split(".")[1] if "." in module else "__init__"
    for layer, tops in LAYERS.items():
        if top in tops:
            return layer
    raise AssertionError(f"{module}: not assigned to a layer in tests/test_architecture.py")


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


def test_no_module_imports_a_higher_layer():
    bad = []
    for m, deps in GRAPH.items():
        if m == PKG:
            continue                 # the package's __init__ exports the core API
        for d in deps:
            if d != PKG and ORDER.index(_layer(d)) > ORDER.index(_layer(m)):
                bad.append(f"{m} ({_layer(m)}) imports {d} ({_layer(d)})")
    assert not bad, "\n".join(sorted(bad))


def test_dispatch_imports_no_feature_and_config_no_gate():
    for m, deps in GRAPH.items():
        if m.startswith(f"{PKG}.dispatch"):
            assert not [d for d in deps if d.startswith((f"{PKG}.placement", f"{PKG}.dynamic"))], m
    assert not [d for d in GRAPH[f"{PKG}.config"] if d.startswith(f"{PKG}.gates")]


def _cycles(graph=None):
    """Strongly connected components of more than one module (Tarjan). A package's __init__ counts like any
    module: when it re-exports a submodule that imports the package back (``from . import x``, ``from ..pkg import
    name``), that is a cycle, resolved only by the order Python happens to load them in."""
    edges = LOAD_ORDER if graph is None else graph
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys
    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle_through_a_package_init(tmp_path):
    """pkg/__init__ re-exports pkg.a and pkg.c; pkg.a imports pkg.b; pkg.b takes C from the package's namespace
    (``from . import C``): the cycle pkg -> pkg.a -> pkg.b -> pkg is found; without the re-export of pkg.a it is not."""
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("from .a import A\nfrom .c import C\n")
    (root / "a.py").write_text("from .b import B\nA = 1\n")
    (root / "b.py").write_text("from . import C\nB = C\n")
    (root / "c.py").write_text("C = 3\n")
    modules = _modules(str(root))
    graph = {m: _imports(m, p, modules, "pkg") for m, p in modules.items()}
    assert _cycles(graph) == [["pkg", "pkg.a", "pkg.b"]]
    (root / "__init__.py").write_text("from .c import C\n")
    graph = {m: _imports(m, p, modules, "pkg") for m, p in modules.items()}
    assert _cycles(graph) == []


def test_the_checker_sees_a_load_order_cycle_through_another_package(tmp_path):
    """pkg.a.m imports pkg.b.s (a module): loading it runs pkg.b's __init__, which imports pkg.b.t, which imports
    pkg.a.m back: a cycle at load time though no module imports a package by name. A function-local import with its
    reason commented breaks it."""
    root = tmp_path / "pkg"
    for sub in ("a", "b"):
        (root / sub).mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("")
    (root / "a" / "m.py").write_text("from ..b.s import S\nM = 1\n")
    (root / "b" / "__init__.py").write_text("from . import t\n")
    (root / "b" / "s.py").write_text("S = 2\n")
    (root / "b" / "t.py").write_text("from ..a.m import M\n")
    modules = _modules(str(root))
    graph = {m: _imports(m, p, modules, "pkg", load_order=True) for m, p in modules.items()}
    assert _cycles(graph) == [["pkg.a.m", "pkg.b", "pkg.b.t"]]
    (root / "b" / "t.py").write_text("def f():\n    from ..a.m import M  # load order: pkg.a.m imports pkg.b\n")
    graph = {m: _imports(m, p, modules, "pkg", load_order=True) for m, p in modules.items()}
    assert _cycles(graph) == []


def test_the_checker_sees_deferred_imports(tmp_path):
    # the contract must fail on an import hidden inside a function
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from megamoe_plugin.placement import runtime\n")
    found = _imports(f"{PKG}.dispatch.m", str(src))
    assert f"{PKG}.placement.runtime" in found


@pytest.mark.parametrize("module", [f"{PKG}.dispatch.plan", f"{PKG}.layer"])
def test_core_hot_path_modules_exist(module):
    assert module in MODULES


def test_core_and_features_import_their_own_modules_at_the_top():
    """A function-local import of the package's own modules in the core or the features hides a dependency from
    the reader; allowed only with a comment on its line saying why (an optional dependency, a real load-order
    problem)."""
    hidden = []
    for m, path in MODULES.items():
        if m == PKG or _layer(m) not in ("core", "features"):
            continue
        with open(path) as f:
            src = f.read()
        lines = src.split("\n")
        for fn in ast.walk(ast.parse(src)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PKG)) \
                        and "#" not in lines[node.lineno - 1]:
                    hidden.append(f"{path}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not hidden, "\n".join(hidden)
