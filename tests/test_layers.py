"""The package's three layers, read from its imports: each layer imports only the ones below
it (the parallel core nothing above it; the models not the checkpoint or the jobs; the
checkpoint not the jobs), the jobs generate, score and train never import each other (what
they share is hpcpar.jobs.inputs), the parallel core is one sub-package per concept, and no
module imports itself around a circle. Every import counts, including those inside functions
(a lazy import is still a dependency)."""

import ast
from pathlib import Path

import hpcpar

PACKAGE = Path(hpcpar.__file__).parent
# lowest first (hpcpar.cores, the node's ranks and cores, is standard library only: __main__
# reads it before NumPy loads); the root package (its version) and __main__ sit on top
LAYERS = ("hpcpar.cores", "hpcpar.parallel", "hpcpar.models", "hpcpar.checkpoint",
          "hpcpar.jobs")
# side by side in the jobs layer: each imports neither of the others (hpcpar.jobs.inputs holds
# what they all read)
JOBS = ("hpcpar.jobs.generate", "hpcpar.jobs.score", "hpcpar.jobs.train")
# the parallel core: a sub-package per parallelism or concept, and the few modules all of them
# stand on
CORE_PACKAGES = {"comm", "device", "tensor", "tensor_parallel", "context_parallel",
                 "expert_parallel", "data_parallel", "optim", "pipeline", "ops"}
CORE_MODULES = {"__init__", "mesh", "params", "errors", "environment", "trace", "exports"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module -> the hpcpar modules it imports (a name imported from a package is
    the submodule of that name, when there is one)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "hpcpar":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "hpcpar"}
        edges[name] = found
    return edges


def _layer(module: str) -> int:
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return len(LAYERS)


def test_every_module_belongs_to_a_layer():
    loose = [m for m in _imports() if _layer(m) == len(LAYERS)
             and m not in ("hpcpar", "hpcpar.__main__", "hpcpar.moved")]
    assert loose == [], f"modules outside the layers: {loose}"


def test_each_layer_imports_only_the_layers_below_it():
    upward = sorted(f"{m} imports {t}" for m, targets in _imports().items() for t in targets
                    if t != "hpcpar" and _layer(t) > _layer(m))
    assert upward == [], "\n".join(upward)


def _job(module: str) -> str | None:
    return next((job for job in JOBS if module == job or module.startswith(job + ".")), None)


def test_generate_score_and_train_never_import_each_other():
    across = sorted(f"{m} imports {t}" for m, targets in _imports().items() for t in targets
                    if _job(m) and _job(t) and _job(t) != _job(m))
    assert across == [], "\n".join(across)


def test_no_module_imports_itself_around_a_circle():
    edges = _imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:               # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert circles == [], f"import circles: {circles}"


def test_the_parallel_core_is_a_package_per_concept():
    core = PACKAGE / "parallel"
    packages = {p.name for p in core.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in core.glob("*.py")}
    assert (packages, modules) == (CORE_PACKAGES, CORE_MODULES)
