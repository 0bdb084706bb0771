"""The layers stay layered: each layer imports only those below it (LAYERS: the engine, the
office, the models, HTTP; the server and the CLI, which assemble everything, excepted), route
modules never import each other, and no two modules import each other, however indirectly.
Checked by reading every module's import statements (type-only ones too), with the syntax tree.
Each guard is also run on a deliberate break, so that it is known to fail for what it names."""

import ast
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


# (modules of a layer, by prefix) -> what they may never import, by prefix.
ENGINE = ("localserve.engine",)
OFFICE = ("localserve.office", "localserve.ledger", "localserve.quotas", "localserve.keys",
          "localserve.conversations")
MODELS = ("localserve.registry", "localserve.model_host", "localserve.model_specs")
HTTP = ("localserve.api",)
LAYERS = [(ENGINE, OFFICE + MODELS + HTTP), (OFFICE, MODELS + HTTP), (MODELS, HTTP)]


def layer_breaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    below_http = [(name, target) for name, targets in graph.items() for target in targets
                  if target.startswith(HTTP) and not name.startswith(HTTP)
                  and name not in ASSEMBLERS]
    across = [(name, target) for sources, forbidden in LAYERS for name, targets in graph.items()
              if name.startswith(sources) for target in targets if target.startswith(forbidden)]
    routes = [(name, target) for name, targets in graph.items() for target in targets
              if name.startswith("localserve.api.routes_") and target != name
              and target.startswith("localserve.api.routes_")]
    return sorted(set(below_http + across + routes))


def test_each_layer_imports_only_the_layers_below_and_routes_never_each_other():
    graph = import_graph()
    assert "localserve.registry" in graph and "localserve.api.app" in graph
    assert layer_breaks(graph) == []
    for name, target in [("localserve.engine.scheduler", "localserve.office"),
                         ("localserve.office", "localserve.registry"),
                         ("localserve.model_host", "localserve.api.serving"),
                         ("localserve.api.routes_native", "localserve.api.routes_openai")]:
        broken = {**graph, name: graph[name] | {target}}
        assert layer_breaks(broken) == [(name, target)], (name, target)


def test_no_import_cycles():
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MUTATORS = {"clear", "extend", "append", "pop", "insert", "remove", "sort", "reverse",
            "__setitem__", "__delitem__", "__iadd__"}


def is_cached(node) -> bool:
    """`x.cached`, or a subscript or slice of it."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr == "cached"


def cache_edits(source: str) -> list[int]:
    """Lines that store into `.cached` (=, +=, a slice store, del) or call a mutating method."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        called = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS and is_cached(node.func.value))
        if called or any(is_cached(t) for t in targets):
            lines.append(node.lineno)
    return lines


def test_only_the_slot_edits_what_its_cache_holds():
    """llama.cpp's server_slot owns its prompt cache operations; so does Slot (computed,
    forget, assign): no other module changes `cached`, so it cannot drift from the sequence."""
    editors = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if cache_edits(path.read_text())]
    assert editors == ["engine/slots.py"]
    for edit in ("slot.cached[:] = []", "slot.cached = []", "slot.cached += [1]",
                 "del slot.cached[3:]", "slot.cached.extend(t)", "s.cached[0] = 1",
                 "slot.cached.__setitem__(0, 1)"):
        assert cache_edits(edit) == [1], edit
    assert cache_edits("n = len(slot.cached)\nx = slot.cached[:3]\nslot.cached == []") == []
