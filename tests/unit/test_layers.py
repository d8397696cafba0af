"""The library's structure (docs/design-notes.md, "Layers"): every ``autopar`` import, at module
level or inside a function, goes from a layer to the same or a lower one (an exception would be
listed in KNOWN with why, and one that no longer exists fails the test, so the list only
shrinks); process groups are reached only through autopar.collectives; modules stay under
MAX_LINES lines or say why."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("schedules", "collectives", "passes", "runtime", "parallel", "planner")

# bottom (pure: graphs, schedules, data) to top (the orchestrator); top-level autopar modules by name
LAYERS = {
    "schedules": 0, "collectives": 0, "autopar.errors": 0, "autopar.linear_ce": 0,  # collectives: what graph ops run
    "passes": 1, "autopar.nn": 1, "autopar.plan": 1,          # graph -> graph; the plan as data
    "runtime": 2,                                              # execution
    "parallel": 3, "autopar.muon": 3,                          # one owner per parallelism
    "planner": 4, "autopar.data": 4, "autopar.examples": 4,    # cost model and search
}
ORCHESTRATOR = 5  # every other top-level module: api, build, checkpoint, state, cli, demo, ...

# (importing file, imported unit) -> why it is still there (none now: keep it that way)
KNOWN: dict = {}


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in PACKAGES:
        return parts[1]
    return ".".join(parts[:2])


def _layer(unit: str) -> int:
    return LAYERS.get(unit, ORCHESTRATOR)


def _module_of(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    return "autopar." + ".".join(rel[1:] if rel[0] == "autopar" else rel)


def imports(root: str = ROOT):
    """(file relative to root, importing unit, imported unit) for every cross-unit autopar import."""
    files = [os.path.join(root, p, f) for p in PACKAGES + ("autopar",)
             for f in sorted(os.listdir(os.path.join(root, p))) if f.endswith(".py")]
    for path in files:
        mod = _module_of(path, root)
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = mod.split(".")[: -node.level]
                names = [".".join(base + [node.module])] if node.module else [".".join(base + [a.name])
                                                                               for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = ["autopar." + a.name for a in node.names] if node.module == "autopar" else [node.module]
            else:
                continue
            for name in names:
                if name.startswith("autopar") and _unit(name) != _unit(mod):
                    yield os.path.relpath(path, root), _unit(mod), _unit(name)


def upward(root: str = ROOT) -> set:
    return {(f, b) for f, a, b in imports(root) if _layer(b) > _layer(a)}


def test_imports_go_down_the_layers():
    up = upward()
    assert up - set(KNOWN) == set(), sorted(up - set(KNOWN))
    assert set(KNOWN) - up == set(), f"no longer imported, drop from KNOWN: {sorted(set(KNOWN) - up)}"


def test_process_groups_only_in_collectives():
    """Passes and schedules never call torch.distributed: the ops they put in graphs run their
    collectives through autopar.collectives (the in-graph functional collectives are graph ops:
    importing their module for its autograd registration is allowed)."""
    allowed = {"torch.distributed._functional_collectives"}
    bad = []
    for p in ("schedules", "passes"):
        for f in sorted(os.listdir(os.path.join(ROOT, p))):
            if not f.endswith(".py"):
                continue
            for node in ast.walk(ast.parse(open(os.path.join(ROOT, p, f)).read())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                bad += [f"{p}/{f}: {n}" for n in names if n.startswith("torch.distributed") and n not in allowed]
    assert bad == []


def test_a_pass_importing_the_runtime_fails(tmp_path):
    """The check on a copy of the tree in which one more pass imports the runtime."""
    import shutil

    for p in PACKAGES + ("autopar",):
        shutil.copytree(os.path.join(ROOT, p), tmp_path / p, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "passes" / "split_stages.py", "a") as fh:
        fh.write("\n\ndef _late():\n    from autopar.runtime import execute  # noqa\n    return execute\n")
    assert upward(str(tmp_path)) - set(KNOWN) == {("passes/split_stages.py", "runtime")}


MAX_LINES = 700


def test_modules_stay_readable():
    """L2: no library module over MAX_LINES lines unless its docstring says why
    ("Why this long: ...")."""
    long = []
    for p in PACKAGES + ("autopar", "examples"):
        for f in sorted(os.listdir(os.path.join(ROOT, p))):
            if f.endswith(".py"):
                src = open(os.path.join(ROOT, p, f)).read()
                doc = ast.get_docstring(ast.parse(src)) or ""
                if len(src.splitlines()) > MAX_LINES and "Why this long:" not in doc:
                    long.append(f"{p}/{f}: {len(src.splitlines())} lines")
    assert long == []
