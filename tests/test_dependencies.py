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
    "modeling": {"protocol", "kernels"},  # what the trainer and the teachers share
    "verifiers": {"protocol"},
    "data": {"protocol", "verifiers"},  # row checks are the verifiers'
    "samplers": {"protocol", "kernels"},
    "teachers": {"protocol", "modeling"},  # never the trainer's package
    "environments": {"protocol", "verifiers"},  # the sandbox and the plugin loader are the verifiers'
    "supervisor": {"protocol", "data", "verifiers", "samplers", "learner", "orchestrator", "modeling", "kernels",
                   "teachers", "environments", "configs"},
    # samplers: offline evaluation's engine; learner: the checkpoint's data cursor (learner/checkpoint.py)
    "orchestrator": {"protocol", "data", "verifiers", "samplers", "learner", "environments"},
    "learner": {"protocol", "kernels", "modeling", "data"},
}


def imported_packages(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, our package) of every import of ``cascade_rl.X`` in the file; relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            elif node.level == 1:  # from . import x / from .x import y: this package
                names = [f"cascade_rl.{package}"]
            else:  # from ..other import y: a sibling package of the namespace
                names = [f"cascade_rl.{(node.module or '').split('.')[0]}"]
        else:
            continue
        found += [(node.lineno, name.split(".")[1]) for name in names
                  if name.startswith("cascade_rl.") and name.count(".") >= 1]
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_its_layer_may(package):
    files = sorted((ROOT / package).glob("*.py"))
    assert files, f"no modules under {package}/"
    allowed = ALLOWED[package] | {package}
    broken = [f"{path.relative_to(ROOT)}:{line}: imports cascade_rl.{dep}"
              for path in files for line, dep in imported_packages(path, package) if dep not in allowed]
    assert not broken, f"{package}/ may import only {sorted(allowed)} of ours (docs/ARCHITECTURE.md §1):\n" + \
        "\n".join(broken)


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom . import moe\n\ndef f():\n    from cascade_rl.modeling.logprobs import check_args\n"
                      "    import cascade_rl.samplers.engine\n    from ..teachers import server\n")
    assert imported_packages(module, "kernels") == [(2, "kernels"), (5, "modeling"), (6, "samplers"), (7, "teachers")]
