"""The layout's rules, checked: the scheduler, the policy, the step contract and the KV manager
import no torch; spec/ imports nothing of engine/; no private name crosses a module; file sizes
stay within the style's limits."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specstream"
TORCH_FREE = ["specstream.engine.sched.scheduler", "specstream.engine.sched.admission",
              "specstream.engine.sched.residency", "specstream.engine.sched.groups",
              "specstream.engine.sched.drafts", "specstream.engine.sched.update",
              "specstream.engine.sched.host_split", "specstream.engine.policy.feedback",
              "specstream.engine.policy.shaping", "specstream.engine.policy.round_shape",
              "specstream.engine.policy.estimators", "specstream.engine.contract",
              "specstream.kvcache.manager", "specstream.kvcache.prefix_cache"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_decision_side_imports_no_torch(module: str) -> None:
    """In a fresh interpreter: importing the module leaves torch unimported (the package's
    __init__ imports the offline API, which needs torch, so the module is loaded by path of
    its package without running specstream/__init__.py)."""
    code = (
        "import sys, types, importlib\n"
        f"pkg = types.ModuleType('specstream'); pkg.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['specstream'] = pkg\n"
        f"importlib.import_module({module!r})\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print('torch' if bad else 'ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "ok", f"{module} imports torch"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from X import a, b`` in a file."""
    tree = ast.parse(path.read_text())
    return [(n.module or "", [a.name for a in n.names]) for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)]


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_spec_imports_nothing_of_the_engine() -> None:
    bad = [(p.relative_to(ROOT), m) for p in (PACKAGE / "spec").glob("*.py")
           for m, _ in _imports(p) if m.startswith("specstream.engine")]
    assert not bad


def test_no_private_name_is_imported_across_modules() -> None:
    bad = [(str(p.relative_to(ROOT)), m, n) for p in _sources() for m, names in _imports(p)
           for n in names if m.startswith("specstream") and n.startswith("_")
           and n != "__version__"]
    assert not bad


def test_files_stay_small() -> None:
    """None of the engine's files over 300 lines, none in the repository over 400."""
    lines = {p: len(p.read_text().splitlines())
             for d in ("specstream", "tests", "bench", "scripts") for p in (ROOT / d).rglob("*.py")}
    engine = {str(p.relative_to(ROOT)): n for p, n in lines.items()
              if (PACKAGE / "engine") in p.parents and n > 300}
    anywhere = {str(p.relative_to(ROOT)): n for p, n in lines.items() if n > 400}
    assert not engine and not anywhere
