"""The project as pip installs it: a wheel built from this tree holds every module and data file the tree has.

An editable install (``make install``) maps ``cascade_rl.X`` to ``./X`` whatever pyproject.toml lists, so a
subpackage missing from ``[tool.setuptools] packages`` passes every other test and breaks only a real install,
as it did on the first GPU machine (``cascade_rl.supervisor.launchers`` absent from the wheel)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = (".py", ".yaml", ".cpp")  # the kinds of file a package folder holds that the code reads


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_the_wheel_holds_every_tracked_module_and_data_file(tmp_path):
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top = {pkg: folder for pkg, folder in setuptools["package-dir"].items()}
    # from the tracked files alone: an in-tree build/ left by an earlier build would hide a missing package
    src = tmp_path / "src"
    src.mkdir()
    for path in tracked_files():  # the working tree's version of each
        if (ROOT / path).is_file():
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            (src / path).write_bytes((ROOT / path).read_bytes())
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(tmp_path), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("cascade_rl-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    expected = {}
    for pkg, folder in top.items():
        for path in tracked_files():
            if path.startswith(folder + "/") and path.endswith(SHIPPED):
                expected[path] = pkg.replace(".", "/") + path[len(folder):]
    assert len(expected) > 100, f"too few files found to check: {len(expected)}"
    missing = sorted(src for src, dest in expected.items() if dest not in in_wheel)
    assert not missing, f"not in the wheel (add their packages to pyproject.toml): {missing}"


def test_every_package_folder_is_mapped():
    """A top-level folder of Python modules that imports as ``cascade_rl.X`` is in package-dir, and every
    subfolder with modules is listed in packages."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: pkg for pkg, folder in setuptools["package-dir"].items()}
    listed = set(setuptools["packages"])
    for path in tracked_files():
        if not path.endswith("/__init__.py"):
            continue
        parts = path.split("/")[:-1]
        if parts[0] in folders:
            assert ".".join([folders[parts[0]], *parts[1:]]) in listed, f"{'/'.join(parts)} is not in packages"
