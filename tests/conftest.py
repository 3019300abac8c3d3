"""Shared fixtures (a real tiny model, data files, a tool-SFT'd model: each built offline once per test session)
and how the suite shares two cores.

``make test`` runs it on both cores with pytest-xdist (``-n 2 --dist loadgroup``); a plain
``pytest tests/test_x.py`` runs in one process, as before. Under xdist:

* every test that launches whole runs (``@pytest.mark.slow``: several real processes with heartbeat deadlines)
  is in one group, ``launches``, which one worker runs in order, first: the light tests fill the other core;
  the launches that time nothing against a deadline (``LATE_LAUNCHES``) come last, on whichever worker is free;
* each worker, and what its tests start, runs torch on cores // workers threads (no spinning OpenMP threads
  oversubscribing the cores);
* every other test is grouped with its file: a module fixture is built once, and a file's own resources (a
  sandbox uid range it scans for leftovers) are never used by two workers at once;
* the session fixtures below are built by the first worker that asks, under a file lock, in a folder both
  workers see; the other worker waits and reuses them (the tool SFT alone is about a minute).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# Under xdist the cores are shared out: each worker, and every process its tests start (they inherit the
# environment), runs torch's intra-op pool on cores // workers threads. Set before torch is imported. Without it
# two workers of 2 threads each on 2 cores oversubscribed the machine: OpenMP's threads spin while they wait, and
# a fresh-clone run took 48 min of CPU against 27 in one process.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0)):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))

import torch  # noqa: E402
from filelock import FileLock  # noqa: E402

# No GPU: Triton kernels (kernels/) run in Triton's interpreter. Triton reads this when a kernel is decorated,
# i.e. when its module is imported, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

LAUNCHES = "launches"  # the xdist group of the tests marked slow
# Files of launches that time nothing against a deadline (every stage preset for 2 steps): each test a unit of its
# own, handed out after the light tests, to whichever worker is free, so both finish together (about 4 of the 19
# minutes of launches on 2 cores; one group of every launch left the light tests' worker idle for 8 minutes).
LATE_LAUNCHES = {"test_stage_launches"}
LATE = "late:"  # the prefix of their units


def groups_file(testrunuid: str) -> Path:
    """Where a run's workers leave {nodeid: group} for the scheduler (one file per test run, in the temp dir)."""
    return Path(tempfile.gettempdir()) / f"pytest-groups-{testrunuid}.json"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under ``--dist loadgroup``, in each worker: each test's group (the module docstring), written down for the
    scheduler below; and the launches first, so that the longest group starts at once (``--no-loadscope-reorder``:
    xdist hands the groups out in collection order; by default it starts with the files that hold the most tests).
    Not through xdist's own ``xdist_group`` marker: xdist 3.8 appends the group to ``item._nodeid``, which pytest 9
    no longer reads, so those groups are silently ignored."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup")):
        return
    def group(item) -> str:
        if item.get_closest_marker("slow") is None:
            return item.path.stem
        return LATE + item.nodeid if item.path.stem in LATE_LAUNCHES else LAUNCHES

    def order(item) -> int:  # the launches first, the late launches last, the rest between
        unit = groups[item.nodeid]
        return 0 if unit == LAUNCHES else 2 if unit.startswith(LATE) else 1

    groups = {item.nodeid: group(item) for item in items}
    items.sort(key=order)  # stable: each part keeps its order
    path = groups_file(os.environ["PYTEST_XDIST_TESTRUNUID"])
    mine = path.with_suffix(f".{os.environ['PYTEST_XDIST_WORKER']}")  # every worker writes the same; atomically
    mine.write_text(json.dumps(groups))
    os.replace(mine, path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own; optional: a run without xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups the workers wrote (see above): xdist's scope scheduling, one group a unit."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def __init__(self, config, log) -> None:
            super().__init__(config, log)
            self.groups: dict[str, str] = {}

        def schedule(self) -> None:
            if not self.groups:  # all workers have collected (and written the file) before the first call
                path = groups_file(self.nodes[0].workerinput["testrunuid"])
                self.groups = json.loads(path.read_text())
                path.unlink()
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return self.groups[nodeid]

    return GroupScheduling(config, log)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]):
    """``build(folder)``'s result (JSON-able), built once per test session: under xdist in a folder beside the
    workers' own base temps (the documented xdist recipe), by whichever worker asks first while holding a file
    lock; the others read the result it recorded. A build that failed half way is redone by the next to ask."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built-once"
    root.mkdir(exist_ok=True)
    record = root / f"{name}.json"
    with FileLock(root / f"{name}.lock"):
        if not record.exists():
            folder = root / name
            folder.mkdir(exist_ok=True)
            record.write_text(json.dumps(build(folder)))
    return json.loads(record.read_text())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A randomly initialised Qwen3-MoE tiny model directory (tokenizer trained here)."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return built_once(tmp_path_factory, "tiny", lambda d: str(make_tiny_model(d / "tiny", arch="qwen3_moe")))


@pytest.fixture(scope="session")
def tiny_dense_model(tmp_path_factory) -> str:
    from cascade_rl.learner.tiny_model import make_tiny_model

    return built_once(tmp_path_factory, "tiny-dense", lambda d: str(make_tiny_model(d / "tiny-dense", arch="qwen3")))


@pytest.fixture(scope="session")
def judge_model(tmp_path_factory) -> str:
    """A tiny random dense judge (Qwen3) whose context holds a judge prompt with two responses (the policy's tiny
    model holds 512 tokens)."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return built_once(tmp_path_factory, "judge",
                      lambda d: str(make_tiny_model(d / "model", arch="qwen3", max_len=4096)))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The built-in miniature tasks as data files (``cascade-rl make-data cascade``): {split: {task: path}}."""
    from cascade_rl.data.builtin import write_task_files

    return built_once(tmp_path_factory, "data",
                      lambda d: write_task_files("cascade", d, {"heldout": 16, "rl": 300, "sft": 32}))


@pytest.fixture(scope="session")
def full_data(tmp_path_factory):
    """Every policy task of the paper's cascade in miniature (``cascade-rl make-data full``: the arithmetic
    domains, chat, long_context, code_fn, swe_patch, swe_agent) as data files: {split: {task: path}}."""
    from cascade_rl.data.builtin import write_task_files

    return built_once(tmp_path_factory, "full-data",
                      lambda d: write_task_files("full", d, {"heldout": 8, "rl": 64, "sft": 16}))


@pytest.fixture(scope="session")
def math_data(tiny_data) -> list[str]:
    """Launch overrides for the arithmetic (math) prompts and their 16 held-out questions."""
    return [f"data.files=[{tiny_data['rl']['arithmetic']}]", f"data.eval_files=[{tiny_data['heldout']['arithmetic']}]"]


@pytest.fixture(scope="session")
def prepared():
    """prepared(cfg): a composed launch config with its data prepared in run_dir/data, as the supervisor does
    before any process starts (an Orchestrator built in a test reads it there)."""
    from cascade_rl.supervisor.run_data import prepare_run_data

    def prepare(cfg):
        prepare_run_data(cfg)
        return cfg

    return prepare


@pytest.fixture(scope="session")
def tools_data(tmp_path_factory):
    """The tool miniature as data files (``cascade-rl make-data tools``): {split: {task: path}}."""
    from cascade_rl.data.builtin import write_task_files

    return built_once(tmp_path_factory, "tools-data",
                      lambda d: write_task_files("tools", d, {"heldout": 16, "rl": 300, "sft": 400}))


@pytest.fixture(scope="session")
def tools_model(tmp_path_factory, tools_data) -> str:
    """A tiny model SFT'd briefly on the tool traces (it calls the python tool, mostly in the right form):
    what multi-turn tests sample from. About a minute on 2 cores."""
    from cascade_rl.learner.sft import SFTConfig, run_sft
    from cascade_rl.learner.tiny_model import make_tiny_model

    def build(root: Path) -> str:
        base = make_tiny_model(root / "tools", task="tools")
        files = [str(tools_data["sft"]["tool_arithmetic"]), str(tools_data["sft"]["tool_arithmetic_direct"])]
        run_sft(SFTConfig(model=str(base), out=str(root / "tools-sft"), files=files, steps=120))
        return str(root / "tools-sft")

    return built_once(tmp_path_factory, "tools-models", build)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    """The tiny model's tokenizer (a module may define its own)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def turns(tokenizer):
    """The chat template's side of multi-turn rows (data/render.py ``TurnRenderer``), thinking on."""
    from cascade_rl.data.render import PromptRenderer, TurnRenderer

    return TurnRenderer(PromptRenderer(tokenizer, thinking=True))
