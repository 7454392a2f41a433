"""Three floors, imports only run down (DESIGN.md), counting every import statement, lazy ones in functions too.

1. the pure core: `slime_dsa` itself and its CORE subpackages. No Ray, no HTTP, no processes.
2. the services: trainers/ and rollout/, which never import each other (a process boundary is a package boundary).
3. the drivers: the DRIVERS parts of slime_dsa, which assemble floor 2 from a recipe.
And no import cycles: a module never imports itself back through others.
"""

from __future__ import annotations

import ast
import functools
import shutil
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("slime_dsa", "trainers", "rollout")
SERVICES = ("trainers", "rollout")
CORE = ("models", "ops", "algorithms", "config", "data", "checkpoint", "weights", "devices", "trace_recorder", "gc_watch",
        "gpu_utilization", "interrupts", "durable")
DRIVERS = (
    "orchestrator", "commands", "cli",  # the Ray driver and the command line
    "sft", "indexer",  # one-process jobs: they train with trainers/ pieces and evaluate with rollout/'s engine
    "run_dir", "run_lock", "logging",  # what only drivers use: the run directory and its lock, metrics.jsonl + W&B, reports
)
NOT_IN_CORE = ("ray", "aiohttp", "http", "socket", "subprocess", "multiprocessing", "concurrent")
# Within a floor: the engine stays below its HTTP front; the one-process jobs stay off the Ray driver.
NEVER_IMPORTS = (
    ("rollout.engine", "rollout.server"),
    ("slime_dsa.sft", "slime_dsa.orchestrator"),
    ("slime_dsa.indexer", "slime_dsa.orchestrator"),
    ("slime_dsa.run_dir", "slime_dsa.orchestrator"),
)

def floor(module: str) -> int:
    """1 (core), 2 (services) or 3 (drivers); ValueError for a part of slime_dsa not yet placed on a floor."""
    top, _, rest = module.partition(".")
    if top in SERVICES:
        return 2
    part = rest.partition(".")[0]
    if not part or part in CORE:
        return 1
    if part in DRIVERS:
        return 3
    raise ValueError(f"slime_dsa.{part} is on no floor: add it to CORE or DRIVERS in tests/test_layering.py")


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(path: Path, module: str) -> Iterator[str]:
    """Every dotted name that `path` imports, anywhere in its body; `from a import b` gives a.b."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            yield from (f"{base}.{alias.name}" for alias in node.names)


@functools.cache
def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> our modules it imports, module -> top-level names of other libraries it imports)."""
    files = module_files(root)
    ours: dict[str, set[str]] = {}
    others: dict[str, set[str]] = {}
    for module, path in files.items():
        ours[module], others[module] = set(), set()
        for name in imported_names(path, module):
            if name.partition(".")[0] not in PACKAGES:
                others[module].add(name.partition(".")[0])
                continue
            while name and name not in files:  # `from a.b import name`: the module is a.b
                name = name.rpartition(".")[0]
            if name and name != module:
                ours[module].add(name)
    return ours, others


def layering_errors(root: Path) -> list[str]:
    """Each import that runs up a floor, runs between trainers/ and rollout/, crosses NEVER_IMPORTS, or takes the
    core outside its floor (NOT_IN_CORE)."""
    ours, others = import_graph(root)
    errors = []
    for src in sorted(ours):
        for dst in sorted(ours[src]):
            sideways = floor(src) == floor(dst) == 2 and src.partition(".")[0] != dst.partition(".")[0]
            if floor(dst) > floor(src) or sideways:
                errors.append(f"{src} (floor {floor(src)}) imports {dst} (floor {floor(dst)})")
            elif any(within(src, a) and within(dst, b) for a, b in NEVER_IMPORTS):
                errors.append(f"{src} imports {dst}")
        if floor(src) == 1:
            errors += [f"{src} (floor 1) imports {lib}" for lib in sorted(others[src] & set(NOT_IN_CORE))]
    return errors


def import_cycles(root: Path) -> list[list[str]]:
    """Groups of modules that import each other round a cycle (Tarjan's strongly connected components)."""
    graph = import_graph(root)[0]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_imports_only_run_down():
    assert layering_errors(ROOT) == []


def test_no_import_cycles():
    assert import_cycles(ROOT) == []


def test_the_checker_finds_planted_violations(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))

    def plant(file: str, statement: str) -> None:
        path = tmp_path / file
        path.write_text(path.read_text() + f"\n\ndef _planted():\n    {statement}\n")

    plant("slime_dsa/models/rope.py", "import slime_dsa.orchestrator.train")  # up, lazily
    plant("slime_dsa/config/loader.py", "from slime_dsa import cli")  # up, through `from package import module`
    plant("trainers/base.py", "from rollout import client")  # sideways
    plant("slime_dsa/data/sample.py", "import ray")  # Ray in the core
    plant("rollout/engine/stop.py", "from rollout.server.defaults import DEFAULT_PORT")  # the engine on its front
    plant("slime_dsa/ops/reference.py", "from slime_dsa.algorithms import indexer_loss")  # a cycle through ops
    assert layering_errors(tmp_path) == [
        "rollout.engine.stop imports rollout.server.defaults",
        "slime_dsa.config.loader (floor 1) imports slime_dsa.cli (floor 3)",
        "slime_dsa.data.sample (floor 1) imports ray",
        "slime_dsa.models.rope (floor 1) imports slime_dsa.orchestrator.train (floor 3)",
        "trainers.base (floor 2) imports rollout.client (floor 2)",
    ]
    cycle = {"slime_dsa.algorithms.indexer_loss", "slime_dsa.ops", "slime_dsa.ops.reference"}
    assert [group for group in import_cycles(tmp_path) if cycle <= set(group)], import_cycles(tmp_path)
