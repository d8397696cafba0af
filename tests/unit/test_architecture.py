"""The package's import structure, read from the source (every import statement, also those
inside functions): the core never imports the examples, nothing outside tests/ imports tests,
no two modules import each other through any chain, and api.py stays the user-facing layer."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# folder -> package it is installed as (pyproject.toml's package-dir)
PACKAGES = {"autopar": "autopar", "passes": "autopar.passes", "planner": "autopar.planner",
            "runtime": "autopar.runtime", "parallel": "autopar.parallel", "schedules": "autopar.schedules",
            "examples": "autopar.examples"}
CORE = ("autopar.passes", "autopar.schedules", "autopar.runtime", "autopar.parallel", "autopar.planner",
        "autopar.api", "autopar.build", "autopar.nn", "autopar.plan", "autopar.inspect")
MAY_USE_EXAMPLES = ("autopar.planner.presets", "autopar.demo")


def _modules() -> dict[str, str]:
    """Module name -> source path for every module of the installed package."""
    out = {}
    for folder, package in PACKAGES.items():
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                mod = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                out[mod] = os.path.join(ROOT, folder, name)
    return out


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """Every module of ours (or tests.*) that ``module`` imports anywhere in its source."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module
            names = [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]
        else:
            continue
        for n in names:
            if n in known or n.split(".")[0] == "tests":
                out.add(n)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) - {m} for m, p in mods.items()}


def test_core_never_imports_the_examples():
    bad = {m: sorted(d for d in deps if d.startswith("autopar.examples"))
           for m, deps in _graph().items() if m.startswith(CORE) and not m.startswith(MAY_USE_EXAMPLES)}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_only_tests_import_tests():
    graph = _graph()
    bad = {m: sorted(d for d in deps if d.startswith("tests")) for m, deps in graph.items()}
    bench = os.path.join(ROOT, "benchmarks")
    for name in os.listdir(bench):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(bench, name)).read())
            mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            bad[f"benchmarks/{name}"] = sorted(m for m in mods if m.split(".")[0] == "tests")
    assert not {m: d for m, d in bad.items() if d}, bad


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_walk_sees_imports_inside_functions():
    """The oracle for the checks above: a known lazy import (the planner, inside build's
    choose_plan) and a known relative one (runtime/local.py's stage_work) are found."""
    graph = _graph()
    assert "autopar.planner" in graph["autopar.build"]
    assert "autopar.runtime.stage_work" in graph["autopar.runtime.local"]


def test_api_is_the_user_facing_layer():
    """api.py is short and touches no private attribute of anything but itself."""
    path = os.path.join(ROOT, "autopar", "api.py")
    src = open(path).read()
    assert len(src.splitlines()) <= 250
    private = [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(src))
               if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
               and not (isinstance(n.value, ast.Name) and n.value.id == "self")]
    assert not private, private
