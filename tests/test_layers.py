"""The layers stay layered: nothing below the HTTP package imports it (the server and the CLI,
which assemble everything, excepted), and no two modules import each other, however
indirectly. Checked by reading every module's import statements (type-only ones too)."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "localserve"
ASSEMBLERS = {"localserve.server", "localserve.cli"}  # build the app: they may import api/


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("localserve"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    graph[name].add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith("localserve")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on:
                low[node] = min(low[node], index[child])
    return found


def test_nothing_below_the_http_layer_imports_it():
    graph = import_graph()
    assert "localserve.registry" in graph and "localserve.api.app" in graph
    upward = sorted((name, target) for name, targets in graph.items() for target in targets
                    if target.startswith("localserve.api") and not name.startswith("localserve.api")
                    and name not in ASSEMBLERS)
    assert upward == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_slot_edits_what_its_cache_holds():
    """llama.cpp's server_slot owns its prompt cache operations; so does Slot (computed,
    forget, assign): no other module changes `cached`, so it cannot drift from the sequence."""
    edit = re.compile(r"\.cached\s*(=[^=]|\+=)|\.cached\.(clear|extend|append|pop|insert|remove)"
                      r"\(|del [\w.]+\.cached\[")
    editors = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if edit.search(path.read_text())]
    assert editors == ["engine/slots.py"]
