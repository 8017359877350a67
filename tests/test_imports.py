"""The import picture of docs/ARCHITECTURE.md: packages import only those below them (no upward arrows), and
no module imports itself through others (no cycles), counting the imports inside functions too. Imports under
`if TYPE_CHECKING:` never run (annotations only), so they count for the arrows but not for cycles. Only the two
wrappers, common/distributed.py and common/sharding.py, call torch.distributed."""
from __future__ import annotations

import ast

from tests._util import REPO

ALLOWED = {"dit": set(), "common": set(), "shards": {"common"}, "extract": {"common", "shards"},
           "sample": {"common", "dit"}, "train": {"common", "shards", "dit", "sample", "evaluate"},
           "evaluate": {"common", "sample"}}


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING" for stmt in node.body for n in ast.walk(stmt)}


def _imports(runtime_only: bool = False) -> dict[str, set[str]]:
    """'pkg.module' -> the 'pkg.module' names (or 'pkg' for a package) it imports from dit_pipeline."""
    out: dict[str, set[str]] = {}
    for pkg in ALLOWED:
        for f in sorted((REPO / pkg).glob("*.py")):
            deps = out.setdefault(f"{pkg}.{f.stem}", set())
            tree = ast.parse(f.read_text(encoding="utf-8"))
            skip = _type_only(tree) if runtime_only else set()
            for node in ast.walk(tree):
                if id(node) in skip:
                    continue
                if isinstance(node, ast.ImportFrom) and node.level:  # `from .x import y`, `from . import x`
                    deps.update([f"{pkg}.{node.module}"] if node.module else [f"{pkg}.{a.name}" for a in node.names])
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dit_pipeline."):
                    parts = node.module.split(".")[1:]
                    deps.update(f"{parts[0]}.{a.name}" for a in node.names) if len(parts) == 1 else \
                        deps.add(".".join(parts[:2]))
    return out


def test_no_upward_arrows():
    bad = [f"{mod} imports {dep}" for mod, deps in _imports().items() for dep in deps
           if (target := dep.split(".")[0]) != mod.split(".")[0] and target not in ALLOWED[mod.split(".")[0]]]
    assert bad == []


def test_no_import_cycles():
    graph = _imports(runtime_only=True)
    assert "train.loop" in _imports()["train.diverge"] - graph["train.diverge"]  # a type-only import is seen
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (cycle := visit(d, path + [d])):
                return cycle
        state[m] = 2
        return None

    # the first cycle found (a search stopped at one leaves its path marked, so it is the only one reported)
    cycle = next((c for m in sorted(graph) if m not in state and (c := visit(m, [m]))), None)
    assert cycle is None
    assert "train.loop" in graph and "train.state" in graph["train.loop"]  # the walk sees real edges


def _uses_torch_distributed(tree: ast.Module) -> bool:
    """An import of torch.distributed (or of anything under it), or a `torch.distributed` attribute."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "torch.distributed" or a.name.startswith("torch.distributed.")
                                                for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (
                (node.module or "").split(".")[:2] == ["torch", "distributed"]
                or (node.module == "torch" and any(a.name == "distributed" for a in node.names))):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            return True
    return False


def test_only_the_wrappers_call_torch_distributed():
    files = sorted(REPO.glob("*.py")) + [f for pkg in ALLOWED for f in sorted((REPO / pkg).glob("*.py"))]
    users = {f"{f.parent.name}.{f.stem}" if f.parent != REPO else f.stem for f in files
             if _uses_torch_distributed(ast.parse(f.read_text(encoding="utf-8")))}
    # train/torchrun.py starts torchrun itself (torch.distributed.run), and joins no process group
    assert users == {"common.distributed", "common.sharding", "train.torchrun"}
