"""No environment reads below the entry points (issue 43): checked on the source text, as test_layering is.

The environment is read where a process or a user's call begins: the `__main__` modules, the
CLI and its verbs, the Settings module (the one reader), and the few public calls a user's
program makes that take their defaults from the environment as `wandb.init` does (ENTRY_CALLS).
Everything below takes values as arguments, so a rule can be tested without setting a variable.

A read is `os.environ` / `os.getenv` (or `environ` / `getenv` imported from os), and a call of
the settings readers that read the process's environment: `read_setting(name)` and
`is_set(name)` without an `environ` argument, `Settings.from_env()` without one, `state_dir()`.
A call of a function that reads is not followed: the reader itself is
listed here. KNOWN holds the readers that stay, each with its reason; the test also fails
when one of them no longer reads, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("producers", "streams", "sinks", "grafana", "areal_train", "areal_metrics")

ENTRY_MODULES = {
    "areal_metrics/cli.py",
    "producers/contract/settings.py",  # Settings: the one place a variable is parsed
}
ENTRY_FOLDERS = ("areal_metrics/commands/",)  # each verb is a main

# (module, function): public calls whose defaults come from the environment, the user's entry
ENTRY_CALLS = {
    # a Publisher built by a user's program: topics and journal_dir left out take the environment's prefix and
    # state folder, settings=None reads them all (the client and the CLI pass every value)
    ("producers/delivery/publisher.py", "Publisher.__init__"),
    ("producers/delivery/publisher.py", "Publisher.from_settings"),
    ("sinks/query.py", "connect"),  # connect(): the store the environment names
    ("producers/client/run.py", "init"),  # areal_metrics.init: its Settings, the job's run id
    ("producers/client/run.py", "_identity"),  # init's: the launcher's RANK, WORLD_SIZE, ...
    # the services' supervisor is a process of its own (`python -m areal_metrics.stack.supervisor`): its main
    # reads StackSettings (AREAL_RESTART_*) and the state folder once and passes them down
    ("areal_metrics/stack/supervisor.py", "main"),
    # the reference trainer's processes: a torchrun rank (`python -m areal_metrics.areal_train.worker`: the
    # launcher's RANK and WORLD_SIZE, the warm starts' folder, the state folder), the warm start's builder and
    # the probe; each main reads them once and passes them down (train(), warmstart.load())
    ("areal_train/worker.py", "main"),
    ("areal_train/warmstart.py", "main"),
    ("areal_train/probe.py", "main"),
}

# library modules that read the environment, each with its reason: a launcher's variable a process must read
# where the launcher put it, or the environment of a child process being built (module -> why)
KNOWN = {
    "producers/client/run_info.py": "passes the environment on to `git` (a child process), reads no setting",
    "areal_train/board.py": "MASTER_ADDR/MASTER_PORT of the torch launcher",
    "areal_train/launch.py": "builds the environment of the processes it launches",
    "areal_train/host.py": "sets RANK for the processes it starts",
    "areal_metrics/integrations/areal.py": "the AReaL launcher's RANK",
    "areal_metrics/stack/services.py": "builds the services' environment; AREAL_CLICKHOUSE_URL",
}

READERS = {"read_setting": 2, "is_set": 2, "from_env": 1, "state_dir": 1}  # name -> args when the environ is given


def library_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def env_reads(path: Path) -> list[tuple[int, str, str]]:
    """(line, enclosing function's qualified name, what) of each environment read in one file."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "os" \
                    and child.attr in ("environ", "environb", "getenv"):
                out.append((child.lineno, scope, f"os.{child.attr}"))
            elif isinstance(child, ast.ImportFrom) and child.module == "os":
                out.extend((child.lineno, scope, f"from os import {a.name}") for a in child.names
                           if a.name in ("environ", "environb", "getenv"))
            elif isinstance(child, ast.Call):
                func = child.func
                # the settings' functions by their own name; from_env as a class's method (Settings.from_env)
                name = func.attr if isinstance(func, ast.Attribute) and func.attr == "from_env" \
                    else func.id if isinstance(func, ast.Name) else ""
                given = len(child.args) + sum(k.arg == "environ" for k in child.keywords)
                if name in READERS and given < READERS[name]:
                    out.append((child.lineno, scope, f"{name}()"))
            visit(child, inner)

    visit(tree, "")
    return out


def is_entry(rel: str) -> bool:
    return rel in ENTRY_MODULES or rel.endswith("__main__.py") or rel.startswith(ENTRY_FOLDERS)


def test_no_library_module_reads_the_environment() -> None:
    found = []
    for path in library_modules():
        rel = path.relative_to(ROOT).as_posix()
        if is_entry(rel) or rel in KNOWN:
            continue
        for line, scope, what in env_reads(path):
            if any(rel == m and (scope == f or scope.startswith(f + ".")) for m, f in ENTRY_CALLS):
                continue
            found.append(f"{rel}:{line} {scope or '<module>'}: {what}")
    assert found == [], "read the value at the entry point and pass it in:\n" + "\n".join(found)


def test_each_known_reader_still_reads_and_each_entry_call_exists() -> None:
    stale = [rel for rel in KNOWN if not env_reads(ROOT / rel)]
    assert stale == [], f"no longer reads the environment: take it off KNOWN: {stale}"
    for rel, scope in ENTRY_CALLS:
        assert any(s == scope or s.startswith(scope + ".") for _, s, _ in env_reads(ROOT / rel)), (rel, scope)


def test_the_scan_sees_each_kind_of_read(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nfrom os import getenv\n"
        "A = os.environ.get('X')\n"
        "def f():\n    return read_setting('home')\n"
        "def g(env):\n    return read_setting('home', env), is_set('x', environ=env), Settings.from_env(env)\n"
        "class C:\n    def h(self):\n        return Settings.from_env(), state_dir(), is_set('y'), os.getenv('Z')\n"
        "def k(settings):\n    return settings.state_dir\n")
    assert [(line, scope, what) for line, scope, what in env_reads(src)] == [
        (2, "", "from os import getenv"), (3, "", "os.environ"), (5, "f", "read_setting()"),
        (10, "C.h", "from_env()"), (10, "C.h", "state_dir()"), (10, "C.h", "is_set()"), (10, "C.h", "os.getenv")]
