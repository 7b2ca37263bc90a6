"""engine/'s modules import each other without cycles, counting every import: at module level,
under `if TYPE_CHECKING:` and inside functions (read from the source, nothing imported). Only the
package __init__ and the hooks import core.py; its helpers get the RelayEngine's state passed in."""

import ast
from pathlib import Path

import vllm_relay.engine

ENGINE = Path(vllm_relay.engine.__file__).parent
PREFIX = "vllm_relay.engine"


def imports(path: Path) -> set[str]:
    """engine/ modules that `path` imports (by stem; "__init__" for the package itself)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if name == PREFIX:
                found.add("__init__")
            elif name.startswith(PREFIX + ".") and (ENGINE / f"{parts[2]}.py").exists():
                found.add(parts[2])
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    return {p.stem: imports(p) for p in ENGINE.glob("*.py")}


def test_no_import_cycles():
    edges = graph()
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module):] + [module])}"
        if module in done:
            return
        path.append(module)
        for dep in sorted(edges[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(edges):
        visit(module)


def test_only_the_package_imports_core():
    assert {m for m, deps in graph().items() if "core" in deps} == {"__init__"}
