"""The layers stay layered: every module sits in a layer's folder (LAYERS: ground, the engine,
the office, the models, HTTP, the benchmarks, and the assembly at the root), each layer imports
only the layers it may, only the app imports route modules, the writers never reach into the
engine or the serving core, llama.cpp's bindings stay in the runner and the runner behind the
models layer, the HTTP layer meets the engine at two doors, and no two modules import each
other, however indirectly.
Checked by reading every module's import statements (type-only ones too), with the syntax tree.
Each guard is also run on a deliberate break, so that it is known to fail for what it names."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "localserve"


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
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(LLAMA):
                graph[name].add(LLAMA)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith("localserve")}
                graph[name] |= {LLAMA for a in node.names if a.name.split(".")[0] == LLAMA}
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


# The layers, each a folder (or, for the assembly, the modules at the package's root), and
# the layers each may import besides itself. Ground is at the bottom; the assembly (the server
# and the CLI build everything) at the top; the benchmarks are clients of any server.
LAYERS = {
    "ground": (("localserve", "localserve.common"), ()),
    "engine": (("localserve.engine",), ("ground",)),
    "office": (("localserve.office",), ("ground", "engine")),
    "models": (("localserve.models",), ("ground", "engine", "office")),
    "http": (("localserve.api", "localserve.web"), ("ground", "engine", "office", "models")),
    "bench": (("localserve.bench",), ("ground",)),
    "assembly": (("localserve.__main__", "localserve.cli", "localserve.server",
                  "localserve.settings_loader", "localserve.options", "localserve.rpc_worker",
                  "localserve.listen"),
                 ("ground", "engine", "office", "models", "http", "bench")),
}
ROUTES = "localserve.api.routes_"
ROUTE_IMPORTER = "localserve.api.app"  # the one module that mounts the routers
# The writers turn an answer's pieces into one API's shape: they read pieces (answer.py) and
# schemas, never the engine, and never the serving core or the admission that feed them.
WRITERS = ("localserve.api.replies", "localserve.api.message_reply",
           "localserve.api.ollama_reply", "localserve.api.response_reply",
           "localserve.api.native_reply")
NOT_FOR_WRITERS = ("localserve.engine", "localserve.api.serving", "localserve.api.admission")
# llama.cpp's bindings are imported by the runner only; the runner by itself, the models layer
# that builds it, and the RPC worker's start. The HTTP layer reaches the engine through two
# doors only: the serving core (requests in) and the answer's pieces (tokens out).
LLAMA = "llama_cpp"
RUNNER = "localserve.engine.runner"
RUNNER_USERS = (RUNNER, "localserve.models", "localserve.rpc_worker")
ENGINE_DOORS = ("localserve.api.serving", "localserve.api.answer")


def layer_of(module: str) -> str | None:
    """The layer whose folder holds the module: the root package's own modules are matched by
    name (the root package is a prefix of every name), folders by prefix."""
    for layer, (homes, _) in LAYERS.items():
        for home in homes:
            if module == home or (home.count(".") and module.startswith(home + ".")):
                return layer
    return None


def unplaced(graph: dict[str, set[str]]) -> list[str]:
    return sorted(name for name in graph if layer_of(name) is None)


def layer_breaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    breaks = set()
    for name, targets in graph.items():
        layer = layer_of(name)
        for target in targets - {name}:
            below = layer_of(target)
            if layer and below and below != layer and below not in LAYERS[layer][1]:
                breaks.add((name, target))
            if target.startswith(ROUTES) and name != ROUTE_IMPORTER:
                breaks.add((name, target))
            if name.startswith(WRITERS) and target.startswith(NOT_FOR_WRITERS):
                breaks.add((name, target))
            if target == LLAMA and not name.startswith(RUNNER + "."):
                breaks.add((name, target))
            if target.startswith(RUNNER) and not name.startswith(RUNNER_USERS):
                breaks.add((name, target))
            if layer == "http" and target.startswith("localserve.engine") and \
                    name not in ENGINE_DOORS:
                breaks.add((name, target))
    return sorted(breaks)


def test_every_module_sits_in_a_layer_and_imports_only_the_layers_it_may():
    graph = import_graph()
    assert "localserve.models.registry" in graph and "localserve.api.app" in graph
    assert LLAMA in graph["localserve.engine.runner.core"]  # third-party: llama.cpp's only
    assert unplaced(graph) == []
    assert unplaced({**graph, "localserve.stray": set()}) == ["localserve.stray"]
    assert layer_breaks(graph) == []
    for name, target in [("localserve.common.config", "localserve.office.keys"),
                         ("localserve.common.net", "localserve.engine.request"),
                         ("localserve.engine.scheduler", "localserve.office.office"),
                         ("localserve.office.office", "localserve.models.registry"),
                         ("localserve.models.model_host", "localserve.api.serving"),
                         ("localserve.bench.load", "localserve.api.schemas"),
                         ("localserve.api.routes_native", "localserve.api.routes_openai"),
                         ("localserve.api.ollama_reply", "localserve.api.routes_ollama"),
                         ("localserve.api.serving", "localserve.api.routes_openai"),
                         ("localserve.api.message_reply", "localserve.engine.request"),
                         ("localserve.api.replies", "localserve.api.serving"),
                         ("localserve.api.response_reply", "localserve.api.admission"),
                         ("localserve.engine.scheduler", LLAMA),
                         ("localserve.models.registry", LLAMA),
                         ("localserve.api.images", "localserve.engine.runner.mtmd"),
                         ("localserve.office.office", "localserve.engine.runner"),
                         ("localserve.engine.loop", "localserve.engine.runner.core"),
                         ("localserve.api.embedding", "localserve.engine.request")]:
        broken = {**graph, name: graph[name] | {target}}
        assert layer_breaks(broken) == [(name, target)], (name, target)


def test_no_import_cycles():
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_slot_edits_what_its_cache_holds():
    """llama.cpp's server_slot owns its prompt cache operations; so does Slot (computed,
    forget, assign): `cached` is a read-only view, so no other module (nor an alias of it, nor
    list's methods called on it) can change it and make it drift from the sequence."""
    from localserve.engine.slots import Slot

    slot = Slot(0, 64)
    slot.computed([1, 2, 3])
    view = slot.cached
    with pytest.raises(AttributeError):
        slot.cached = []
    with pytest.raises(TypeError):
        view[0] = 9
    with pytest.raises(TypeError):
        del view[1:]
    with pytest.raises(TypeError):
        list.clear(view)
    with pytest.raises(AttributeError):
        view.extend([4])
    sliced = view[:2]
    sliced.append(7)  # a slice is a copy
    assert list(slot.cached) == [1, 2, 3] and len(slot.cached) == 3 and slot.cached[1] == 2
    slot.forget()
    assert list(view) == [] and not slot.cached  # the view follows the slot's own edits


def scheduler_names_used(source: str) -> set[str]:
    """Every name the code reaches through a `.scheduler` handle (`self.scheduler.x`,
    `loop.scheduler.x`, `self.loop.scheduler.x`), a variable named `scheduler`, or any name
    given such a handle (`s = self.scheduler; s.x`), `getattr(handle, "x")` included; a handle
    passed to a function whole counts as PASSED (the helper could read anything)."""
    tree = ast.parse(source)
    aliases = {"scheduler"} | {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                               and isinstance(node.value, ast.Attribute) and node.value.attr == "scheduler"
                               for target in node.targets if isinstance(target, ast.Name)}
    def is_handle(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "scheduler"
                or isinstance(node, ast.Name) and node.id in aliases)

    def is_engines(node) -> bool:  # not a setting that shares the name (Settings.scheduler)
        return is_handle(node) and not (isinstance(node, ast.Attribute) and isinstance(
            node.value, ast.Name) and node.value.id not in ("self", "loop"))

    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_handle(node.value):
            used.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "getattr" and node.args and is_handle(node.args[0]):
            name = node.args[1] if len(node.args) > 1 else None
            used.add(name.value if isinstance(name, ast.Constant) else PASSED)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) not in CHECKED_HOLDERS \
                and any(is_engines(a) for a in [*node.args, *(k.value for k in node.keywords)]):
            used.add(PASSED)
    return used


PASSED = "<the scheduler passed whole>"
CHECKED_HOLDERS = {"EngineLoop"}  # given the scheduler, and read by these guards themselves


def test_the_loop_asks_the_scheduler_only_what_its_protocol_names():
    """vLLM's engine core talks to its scheduler through one interface; so does EngineLoop
    (interfaces.StepScheduler): it never reaches into the scheduler's bookkeepers, and the
    Scheduler has every method of the Protocol with the same parameters."""
    import inspect

    from localserve.engine.interfaces import StepScheduler
    from localserve.engine.scheduler import Scheduler

    named = {n for n in dir(StepScheduler) if not n.startswith("_")}
    loop_source = (PACKAGE / "engine" / "loop.py").read_text()
    assert scheduler_names_used(loop_source) <= named
    assert scheduler_names_used("self.scheduler.cells.preempt_newest()") == {"cells"}  # breaks
    assert scheduler_names_used("n = getattr(self.scheduler, 'pool').free") == {"pool"}
    assert scheduler_names_used("n = room(self.scheduler)") == {PASSED}
    for name in named:
        ours, theirs = getattr(Scheduler, name), getattr(StepScheduler, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


def test_nothing_outside_the_scheduler_reads_past_its_protocol():
    """The snapshot and the model host read what the scheduler publishes (view(), limits(),
    grammar_refusal(), keep_sequences()), never its pool, queue, stats or bookkeepers: vLLM's
    make_stats(). Every module but the scheduler's own is checked."""
    from localserve.engine.interfaces import StepScheduler

    named = {n for n in dir(StepScheduler) if not n.startswith("_")}
    own = {"scheduler.py", "policies.py", "scheduler_view.py"}
    past = {str(path.relative_to(PACKAGE)): sorted(scheduler_names_used(path.read_text()) - named)
            for path in PACKAGE.rglob("*.py") if path.name not in own}
    assert {path: names for path, names in past.items() if names} == {}
    assert scheduler_names_used("pool = self.loop.scheduler.pool") == {"pool"}  # a break, seen
    assert scheduler_names_used("s = self.loop.scheduler\nn = s.waiting") == {"waiting"}  # aliased


def imported_names(source: str, module: str) -> set[str]:
    return {alias.name for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module == module for alias in node.names}


def test_writers_take_only_answer_pys_own_names_from_it():
    """answer.py reads the engine's events for every writer; a writer that imported an engine
    name through it (TokenEvent, ChoiceStreams...) would depend on the engine unseen."""
    answer = ast.parse((PACKAGE / "api" / "answer.py").read_text())
    own = {node.name for node in answer.body if isinstance(node, (ast.ClassDef, ast.FunctionDef,
                                                                  ast.AsyncFunctionDef))}
    own |= {t.id for node in answer.body if isinstance(node, ast.Assign) for t in node.targets
            if isinstance(t, ast.Name)}
    taken = {str(path.relative_to(PACKAGE)): imported_names(path.read_text(), "localserve.api.answer") - own
             for path in PACKAGE.rglob("*.py")}
    assert {path: names for path, names in taken.items() if names} == {}
    assert imported_names("from localserve.api.answer import TokenEvent, Text",
                          "localserve.api.answer") - own == {"TokenEvent"}  # a break, seen


def host_internals_named(source: str) -> set[str]:
    """`host.runner`, `host.loop` (or through `x.host`): the model host's insides, which only
    its own methods, its face (models/model_host.py), read."""
    def is_host(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "host" \
            or isinstance(node, ast.Attribute) and node.attr == "host"
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and node.attr in ("runner", "loop") and is_host(node.value)}


def test_the_http_side_reaches_no_runner_or_loop_past_the_hosts_face():
    named = {str(path.relative_to(PACKAGE)): host_internals_named(path.read_text())
             for path in (PACKAGE / "api").rglob("*.py")}
    assert {path: names for path, names in named.items() if names} == {}
    assert host_internals_named("n = host.runner.n_embd") == {"runner"}  # a break, seen
    assert host_internals_named("s = self.host.loop.snapshot") == {"loop"}


MAX_MODULE_LINES = 400  # DEVELOPERS' layout: no module past 400 lines


def test_no_module_is_past_400_lines():
    root = PACKAGE.parent
    long = {str(path.relative_to(root)): n for path in [*PACKAGE.rglob("*.py"),
                                                        *(root / "tui").rglob("*.py")]
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def long_functions(source: str, most: int) -> dict[str, int]:
    """Functions whose code, docstring aside, runs past `most` lines."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if body and (n := body[-1].end_lineno - body[0].lineno + 1) > most:
                found[node.name] = n
    return found


def test_the_schedulers_rules_are_named_steps_of_at_most_30_lines():
    """Scheduler.schedule reads as its steps (room, lanes, decode rows, chats, tasks), each a
    method a newcomer reads at once; its invariants stay written in its docstring."""
    source = (PACKAGE / "engine" / "scheduler.py").read_text()
    assert long_functions(source, 30) == {}
    assert long_functions("def f():\n    '''doc'''\n" + "    x = 1\n" * 31, 30) == {"f": 31}
