"""What scripts/mutation mutates follows the code: `[tool.mutmut] only_mutate` in pyproject.toml
is the set derived here from the layers (tests/test_layers.py), so a module split out of the
scheduler, or a new writer, is mutated from the day it exists, and the score reads for the
modules it names. The set: the scheduler and every engine module it imports (the runner aside:
llama.cpp), every office module, the answer's writers and the rules of the HTTP layer's limits;
less the modules below, each with why the pure tests are not where it is proven."""

import tomllib
from pathlib import Path

from test_layers import PACKAGE, WRITERS, import_graph

ROOT = PACKAGE.parent
NOT_MUTATED = {
    "localserve.engine.interfaces": "Protocols and typed records: declarations, no rule",
    "localserve.engine.prompt_disk": "files on disk: proven by the prompt cache's disk tests",
    "localserve.engine.scheduler_stats": "counters and log lines the dashboards read",
    "localserve.engine.snapshot": "the published copy of the engine's state for /slots",
    "localserve.office.conversations": "the chat page's SQLite store: proven through its routes",
}
HTTP_RULES = ("localserve.api.answer", "localserve.api.limits")


def engine_closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or not name.startswith("localserve.engine.") or \
                name.startswith("localserve.engine.runner"):
            continue
        seen.add(name)
        todo += graph.get(name, ())
    return seen


def derived() -> set[str]:
    graph = import_graph()
    office = {name for name in graph if name.startswith("localserve.office.")}
    modules = engine_closure(graph, "localserve.engine.scheduler") | office | set(WRITERS) | \
        set(HTTP_RULES)
    return {name.replace(".", "/") + ".py" for name in modules - set(NOT_MUTATED)}


def configured() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]["only_mutate"])


def test_the_mutated_modules_are_the_ones_the_layers_name():
    assert configured() == derived(), {"missing": derived() - configured(),
                                       "extra": configured() - derived()}
    assert all((ROOT / path).is_file() for path in configured())


def test_a_module_split_out_of_the_scheduler_is_in_the_set():
    """The derivation follows imports: a new module the scheduler imports is in it."""
    graph = import_graph()
    graph["localserve.engine.scheduler"] = graph["localserve.engine.scheduler"] | {
        "localserve.engine.new_rule"}
    assert "localserve.engine.new_rule" in engine_closure(graph, "localserve.engine.scheduler")
    assert not {m for m in engine_closure(graph, "localserve.engine.scheduler")
                if m.startswith("localserve.engine.runner")}
