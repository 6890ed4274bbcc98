"""Imports flow one way (STYLE.md "Imports flow one way"), checked on the source with `ast`.

Every module's imports count, the lazy ones inside functions and those under `TYPE_CHECKING`
too: a lazy import that runs back up is still a dependency, only a later one. A package may
import from its own layer or the layers below it, never from a layer above; nothing may import in
a cycle, neither module to module nor package to package; actor and learner never import each
other; the JAX-free packages import no JAX.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Bottom to top. A name is a package (folder) or a module of `headrace`'s top level. Names that
# do not exist yet are placed so that they land in the right layer when they come.
LAYERS: tuple[tuple[str, ...], ...] = (
    # axes: mesh axis names that `model` may import; versions: the trained-at forecast;
    # rundir: a run folder's file names; xla_flags: set before JAX starts, by the command line
    # and Ray workers; placement: the CPUs the processes launcher pins its children to
    ("types", "configtree", "config_learner", "config_model", "config", "shapes", "axes",
     "versions", "rundir", "xla_flags", "placement"),
    ("formats",),  # checkpoint files (HF folders, GGUF) read as dicts and arrays
    ("text", "env", "model", "parallel", "metrics", "sim"),
    ("buffer", "weights", "engines"),  # engines: inference servers the actor samples from
    ("actor", "learner"),
    ("audit", "sft", "gateway"),  # gateway: agents reach the policy through it
    ("runtime", "ray", "benchlib"),  # ray: the Ray launcher, should it leave runtime/
    ("benchmarks",),  # one module per `headrace bench NAME`
    ("cli", "examples"),  # examples: configs and agents to copy (users' code)
)
NEVER = {("actor", "learner"), ("learner", "actor")}
NO_JAX = ("types", "configtree", "config_learner", "config_model", "config", "shapes", "axes",
          "versions", "rundir", "xla_flags", "placement", "formats", "text", "env", "sim", "engines")
JAX_ROOTS = ("jax", "jaxlib", "flax", "optax", "orbax")


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. headrace.learner.loop
    target: str  # imported module, e.g. headrace.metrics.traces
    where: str  # path:line of the import

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.where})"


def modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Module name -> file of every module under `root/package`."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(root: pathlib.Path, package: str) -> tuple[list[Edge], dict[str, set[str]]]:
    """(edges between `package`'s modules, module -> external top-level names it imports).

    `from P import name` is an edge to `P.name` when that is a module, else to `P`."""
    known = modules(root, package)
    edges, external = [], {}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        external[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here[:len(here) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            else:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            for target in dict.fromkeys(targets):
                if target == package or target.startswith(package + "."):
                    while target not in known:  # `import headrace.x.y.attr` forms
                        target = target.rsplit(".", 1)[0]
                    if target != name:
                        edges.append(Edge(name, target, where))
                else:
                    external[name].add(target.split(".")[0])
    return edges, external


def top(module: str) -> str:
    """The placed name of a module: its top-level package or module under `headrace`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {name: i for i, names in enumerate(layers) for name in names}


def upward(edges: list[Edge], layers) -> list[Edge]:
    rank = layer_of(layers)
    return [e for e in edges if top(e.source) in rank and top(e.target) in rank
            and rank[top(e.target)] > rank[top(e.source)]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_edges(edges: list[Edge], key, shown=lambda e: True) -> list[str]:
    """Each cycle of the graph `key` makes of `edges` (module or package names), with its
    imports that `shown` keeps (those that close it), one per line."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if key(e.source) != key(e.target):
            graph.setdefault(key(e.source), set()).add(key(e.target))
    lines = []
    for component in cycles(graph):
        members = set(component)
        lines.append("cycle: " + " <-> ".join(component))
        lines += [f"  {e}" for e in edges if key(e.source) in members and shown(e)
                  and key(e.target) in members and key(e.source) != key(e.target)]
    return lines


def report(root: pathlib.Path, package: str, layers) -> list[str]:
    """Every breach of the rules above in `root/package`, one readable line each."""
    edges, external = imports(root, package)
    rank = layer_of(layers)
    problems = [f"not placed in LAYERS: {name}" for name in
                sorted({top(m) for m in modules(root, package)} - set(rank) - {package})]
    problems += [f"upward: {e}  [layer {rank[top(e.source)]} imports layer "
                 f"{rank[top(e.target)]}]" for e in upward(edges, layers)]
    problems += [f"forbidden: {e}" for e in edges if (top(e.source), top(e.target)) in NEVER]
    problems += cycle_edges(edges, lambda m: m)
    # a package cycle among placed packages is closed by its imports that do not point down
    problems += cycle_edges(edges, top, lambda e: rank.get(top(e.target), -1)
                            >= rank.get(top(e.source), 0))
    problems += [f"JAX in a JAX-free package: {m} imports {sorted(external[m] & set(JAX_ROOTS))}"
                 for m in sorted(external) if top(m) in NO_JAX and external[m] & set(JAX_ROOTS)]
    return problems


def test_imports_flow_one_way():
    problems = report(ROOT, "headrace", LAYERS)
    assert not problems, "imports that break STYLE.md's layers:\n" + "\n".join(problems)


def test_every_placed_name_is_placed_once():
    names = [n for names in LAYERS for n in names]
    assert len(names) == len(set(names))


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


LOW_HIGH = (("low",), ("high",))


@pytest.mark.parametrize("files, expected", [
    # a lazy upward import inside a function
    ({"__init__.py": "", "low/__init__.py": "", "high/__init__.py": "",
      "low/a.py": "def f():\n    from pkg.high import b\n", "high/b.py": "import pkg.low.a\n"},
     ["upward: pkg.low.a -> pkg.high.b  (pkg/low/a.py:2)  [layer 0 imports layer 1]",
      "cycle: pkg.high.b <-> pkg.low.a", "cycle: high <-> low"]),
    # a module cycle inside one package, through a relative import under TYPE_CHECKING
    ({"__init__.py": "", "low/__init__.py": "",
      "low/a.py": "from pkg.low import b\n",
      "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"},
     ["cycle: pkg.low.a <-> pkg.low.b"]),
    # an unplaced package, and JAX where none may be (`low` plays `env`)
    ({"__init__.py": "", "env/__init__.py": "", "stray/__init__.py": "",
      "env/a.py": "def f():\n    import jax.numpy\n"},
     ["not placed in LAYERS: stray"]),
])
def test_the_checker_finds_planted_breaches(tmp_path, files, expected):
    layers = LOW_HIGH + (("env",),)
    problems = report(_tree(tmp_path, files), "pkg", layers)
    for line in expected:
        assert any(p.startswith(line) for p in problems), (line, problems)
    if "env/a.py" in files:
        assert any(p.startswith("JAX in a JAX-free package: pkg.env.a") for p in problems)
    assert report(_tree(tmp_path / "clean", {"__init__.py": "", "low/__init__.py": "",
                                             "high/__init__.py": "",
                                             "high/b.py": "from pkg.low import x\n"}),
                  "pkg", LOW_HIGH) == []
