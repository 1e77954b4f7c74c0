"""The verifier's service is the one boundary (server/verifier/scheduling/service.py): the routes
and the fast path reach the engine only through it, and the text pool runs only what
reads the vocabulary (`Engine.tokenize`, `Engine.detokenize`), never what touches a
session, which is the engine thread's. Read from the source, so that a change that
crosses the boundary fails here rather than as a race."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = ROOT / "server" / "verifier"
TEXT_POOL_SAFE = {"tokenize", "detokenize"}


def attributes(path: Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


def test_routes_and_the_fast_path_call_the_service_only():
    for path in [
        *sorted((VERIFIER / "edge" / "routes").glob("*.py")),
        VERIFIER / "edge" / "round_path.py",
    ]:
        reached = attributes(path) & {"engine", "runtime", "sessions", "scheduler", "grammars"}
        assert not reached, f"{path.relative_to(ROOT)} reaches past the service: {reached}"


def test_the_text_pool_runs_only_what_reads_the_vocabulary():
    tree = ast.parse((VERIFIER / "scheduling" / "service.py").read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "_in_text_pool"
    ]
    assert calls, "the service no longer uses its text pool: update this test"
    for call in calls:
        fn = call.args[0]
        assert isinstance(fn, ast.Attribute) and fn.attr in TEXT_POOL_SAFE, ast.unparse(fn)
        assert ast.unparse(fn.value) == "self.engine", ast.unparse(fn)


def test_the_engine_says_which_of_its_methods_are_safe_on_any_thread():
    source = (VERIFIER / "decoding" / "engine.py").read_text()
    tree = ast.parse(source)
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    methods = {n.name: n for n in engine.body if isinstance(n, ast.FunctionDef)}
    for name in TEXT_POOL_SAFE:
        body = attributes_of(methods[name])
        assert body <= {"runtime", name}, f"Engine.{name} reads {body}: not the vocabulary only"
    assert "safe on any thread" in source


def attributes_of(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def test_the_service_never_touches_sessions_or_hands_the_engine_thread_a_function():
    """Sessions are the engine thread's: the service ends one through the scheduler's
    `end`, which says what runs there, never with a function of its own over them."""
    tree = ast.parse((VERIFIER / "scheduling" / "service.py").read_text())
    assert "sessions" not in attributes(VERIFIER / "scheduling" / "service.py")
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Lambda)
                and "scheduler" in ast.unparse(n)]  # fmt: skip
    scheduler_calls = {
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and ast.unparse(n.func.value) == "self.scheduler"
    }
    assert scheduler_calls <= {"prefill", "verify", "end", "close"}, scheduler_calls
