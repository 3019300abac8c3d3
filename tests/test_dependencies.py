"""The dependency rules of docs/ARCHITECTURE.md §1, enforced on the source: every import statement of a
package's modules (inside functions too), parsed with ``ast``, so a lazy import breaks the rule as well."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package (a top-level folder) -> the packages of ours its modules may import besides itself
ALLOWED = {
    "protocol": set(),  # imports nothing else of ours
    "kernels": {"protocol"},  # modeling, samplers and the trainer import kernels, never the other way round
    "modeling": {"protocol", "kernels", "weights"},  # what the trainer and the teachers share; weights: adapters
    "verifiers": {"protocol"},
    "data": {"protocol", "verifiers"},  # row checks are the verifiers'
    "weights": {"protocol"},  # weight transports: both sides, so the trainer and the samplers import it
    "samplers": {"protocol", "kernels", "weights"},
    "teachers": {"protocol", "modeling"},  # never the trainer's package
    "environments": {"protocol", "verifiers"},  # the sandbox and the plugin loader are the verifiers'
    "supervisor": {"protocol", "data", "verifiers", "samplers", "learner", "orchestrator", "modeling", "kernels",
                   "teachers", "environments", "configs", "weights", "gateway"},
    # the chat template and tokenizer (data), the tool-call parser (environments), the OpenAI wire format (samplers)
    "gateway": {"protocol", "data", "environments", "samplers"},
    # samplers: offline evaluation's engine; learner: the checkpoint's data cursor (learner/checkpoint.py)
    "orchestrator": {"protocol", "data", "verifiers", "samplers", "learner", "environments"},
    "learner": {"protocol", "kernels", "modeling", "data", "weights"},
}


def imported_packages(path: Path, package: str, folder: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """(line, our package) of every import of ``cascade_rl.X`` in the file; relative imports resolved from
    ``folder``, the file's folders below ``package`` (``("launchers",)`` for supervisor/launchers/x.py)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            elif node.level <= len(folder) + 1:  # from . / from .. inside the package: this package
                names = [f"cascade_rl.{package}"]
            else:  # a level above the package: a sibling package of the namespace
                names = [f"cascade_rl.{(node.module or '').split('.')[0]}"]
        else:
            continue
        found += [(node.lineno, name.split(".")[1]) for name in names
                  if name.startswith("cascade_rl.") and name.count(".") >= 1]
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_its_layer_may(package):
    files = sorted((ROOT / package).rglob("*.py"))  # nested folders too (supervisor/launchers/)
    assert files, f"no modules under {package}/"
    allowed = ALLOWED[package] | {package}
    broken = [f"{path.relative_to(ROOT)}:{line}: imports cascade_rl.{dep}" for path in files
              for line, dep in imported_packages(path, package, path.relative_to(ROOT / package).parent.parts)
              if dep not in allowed]
    assert not broken, f"{package}/ may import only {sorted(allowed)} of ours (docs/ARCHITECTURE.md §1):\n" + \
        "\n".join(broken)


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom . import moe\n\ndef f():\n    from cascade_rl.modeling.logprobs import check_args\n"
                      "    import cascade_rl.samplers.engine\n    from ..teachers import server\n")
    assert imported_packages(module, "kernels") == [(2, "kernels"), (5, "modeling"), (6, "samplers"), (7, "teachers")]


def test_nested_relative_imports_resolve_to_the_package(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from . import rules\nfrom ..procs import free_ports\nfrom ...learner import weights\n")
    assert imported_packages(module, "supervisor", ("launchers",)) == [(1, "supervisor"), (2, "supervisor"),
                                                                       (3, "learner")]


def our_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every ``cascade_rl`` import in a file outside the package (bench/)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("cascade_rl."):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("cascade_rl.")]
    return found


def test_bench_imports_what_the_package_has():
    """bench/ runs only when a session records figures: every ``cascade_rl`` module and name its scripts import
    (inside functions too) must exist, so a rename in the package fails here rather than in the next bench run."""
    import importlib.util

    missing = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for line, module, names in our_imports(path):
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                missing.append(f"{path.relative_to(ROOT)}:{line}: {module}: {e}")
                continue
            missing += [f"{path.relative_to(ROOT)}:{line}: {module} has no {name}" for name in names
                        if not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None]
    assert not missing, "bench/ imports what the package no longer has:\n" + "\n".join(missing)


# a role's process module: its main(), its sockets' service. Nothing but the supervisor (which starts it) imports one
PROCESS_MODULES = {"samplers.worker", "verifiers.worker", "environments.worker", "teachers.server",
                   "learner.trainer", "orchestrator.main"}


def test_no_package_imports_another_roles_process_module():
    """Offline evaluation scores, samples and steps environments in one process: it imports the pieces the workers
    run (samplers/engine.py ``to_generation``, verifiers/scoring.py, environments/steps.py), not the workers."""
    broken = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        package = path.relative_to(ROOT).parts[0]
        if package not in ALLOWED or package == "supervisor":
            continue
        for line, module, names in our_imports(path):
            target = module.removeprefix("cascade_rl.")
            for imported in [target] + [f"{target}.{name}" for name in names]:  # `from cascade_rl.x import worker`
                if imported in PROCESS_MODULES and target.split(".")[0] != package:
                    broken.append(f"{path.relative_to(ROOT)}:{line}: imports cascade_rl.{imported}")
    assert not broken, "a role's process module imported from another package:\n" + "\n".join(broken)
