"""Environments of multi-turn rollouts: the tool-call parser, the calculator, the python tool in the real
sandbox (state by replay, hangs, crashes, fork bombs), and the environment worker as a real process behind a
ROUTER socket in the orchestrator's seat."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import zmq
from omegaconf import OmegaConf

from cascade_rl.environments.base import EnvSettings, StepResult, ToolEnvironment, ToolOutcome, ToolUnavailable
from cascade_rl.environments.calculator import CalcError, evaluate
from cascade_rl.environments.python_tool import PythonTool
from cascade_rl.environments.registry import ENVIRONMENTS, build_environment, register_environment
from cascade_rl.environments.tool_calls import CallError, ToolCall, parse_tool_calls
from cascade_rl.protocol.messages import EnvReply, EnvRequest, Heartbeat, Ready, WorkKey
from cascade_rl.protocol.sockets import bind_router, recv, recv_routed, send
from cascade_rl.verifiers import sandbox

UID_BASE, SLOTS = 63000, 8  # our own uid range: other sandboxes on the machine cannot interfere
needs_sandbox = pytest.mark.skipif(not sandbox.isolation_available(), reason="the sandbox needs root on Linux")


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def turn(*blocks: str, think: str = "<think>\nLet me use a tool.\n</think>\n\n") -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": think + "\n".join(blocks)}]


# --------------------------------------------------------------------------- parser


def test_parse_one_and_several_calls_in_order():
    assert parse_tool_calls(turn(call("python", code="print(1)"))[1]["content"]) == [
        ToolCall("python", {"code": "print(1)"})]
    text = f"First {call('a', x=1)} then some prose {call('b')}\n{call('c', s='t')}"
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {}), ToolCall("c", {"s": "t"})]


def test_parse_errors_take_the_place_of_their_call():
    text = f"{call('a')}<tool_call>{{\"name\": \"b\", \"arguments\": {{</tool_call>{call('c')}"
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("a", {}) and calls[2] == ToolCall("c", {})
    assert isinstance(calls[1], CallError) and "not valid JSON" in calls[1].reason
    [err] = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert isinstance(err, CallError) and '"name"' in err.reason
    [err] = parse_tool_calls('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')
    assert isinstance(err, CallError) and "object" in err.reason
    [err] = parse_tool_calls(call("a", x=1) + '\n<tool_call>{"name": "b", "argu')[1:]
    assert isinstance(err, CallError) and "not closed" in err.reason


def test_parse_reads_only_the_answer_after_thinking():
    assert parse_tool_calls(f"<think>maybe {call('a')}?</think>No tool needed: 4.") == []
    assert parse_tool_calls(f"<think>maybe {call('a')}</think>{call('b')}") == [ToolCall("b", {})]
    assert parse_tool_calls(f"<think>still thinking {call('a')}") == []  # cut off while thinking
    assert parse_tool_calls("The answer is 4.") == []


def test_parse_lenient_forms():
    raw = '<tool_call>{"name": "python", "arguments": {"code": "x = 1\nprint(x)"}}</tool_call>'  # raw newline
    assert parse_tool_calls(raw) == [ToolCall("python", {"code": "x = 1\nprint(x)"})]
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>'
    assert parse_tool_calls(as_string) == [ToolCall("f", {"k": 2})]
    xml = "<tool_call>\n<function=python>\n<parameter=code>\nprint(2)\n</parameter>\n</function>\n</tool_call>"
    assert parse_tool_calls(xml) == [ToolCall("python", {"code": "print(2)"})]


# --------------------------------------------------------------------------- calculator and ToolEnvironment


@pytest.mark.parametrize("expression,value", [("1 + 2 * 3", 7), ("-(2 ** 3) // 3", -3), ("7 / 2", 3.5),
                                              ("2 ** -1", 0.5), ("(10 % 4) ** 10", 1024), ("+1.5e3 - 0.5", 1499.5)])
def test_calculator_values(expression, value):
    assert evaluate(expression) == value and type(evaluate(expression)) is type(value)


@pytest.mark.parametrize("expression,reason", [
    ("x + 1", "names are not allowed"), ("abs(-1)", "function calls"), ("__import__('os').system('id')", "calls"),
    ("'a' * 3", "only numbers"), ("True + 1", "only numbers"), ("(1).real", "Attribute"), ("1 < 2", "Compare"),
    ("9 ** 9 ** 9", "bits"), ("2 ** 4001", "bits"), ("(10 ** 1000) * (10 ** 1000)", "bits"), ("1 / 0", "division"),
    ("10.0 ** 400", "too large"), ("(-8) ** 0.5", "not a real"), ("1 +", "not an arithmetic"), ("1" * 1001, "longer"),
])
def test_calculator_refuses_with_the_reason(expression, reason):
    t0 = time.monotonic()
    with pytest.raises(CalcError, match=reason):
        evaluate(expression)
    assert time.monotonic() - t0 < 0.5  # refused before any big computation


def test_calculator_environment_answers_each_call():
    env = build_environment("calculator")
    r = env.step(turn(call("calculator", expression="6 * 7"), call("calculator", expression="x"),
                      call("calculator", expr="1"), call("search", q="cats")), {}, {})
    contents = [m["content"] for m in r.tool_messages]
    assert not r.done and r.tool_calls == 4 and r.tool_errors == 3 and r.timeouts == 0
    assert all(m["role"] == "tool" for m in r.tool_messages) and contents[0] == "42"
    assert contents[1].startswith("error:") and "names" in contents[1]
    assert "missing argument 'expression'" in contents[2]
    assert "unknown tool 'search'" in contents[3] and "calculator" in contents[3]  # names the tools on offer
    bad = env.step(turn("<tool_call>{oops</tool_call>"), {}, {})
    assert bad.tool_errors == 1 and "not valid JSON" in bad.tool_messages[0]["content"]
    assert "tools on offer: calculator" in bad.tool_messages[0]["content"]


def test_a_turn_without_a_tool_call_is_done():
    r = build_environment("calculator").step(turn("The answer is 42."), {"kept": 1}, {})
    assert r == StepResult(done=True, state={"kept": 1})


def test_call_limit_truncation_and_failing_tools():
    def boom(arguments, state):
        raise KeyError("bug")

    def down(arguments, state):
        raise ToolUnavailable("service down")

    def echo(arguments, state):
        state["n"] = state.get("n", 0) + 1
        return ToolOutcome(arguments.get("text", ""))

    env = ToolEnvironment(EnvSettings(max_calls_per_turn=2, max_output_chars=60), {"echo": echo, "boom": boom,
                                                                                   "down": down})
    given = {"n": 5}
    r = env.step(turn(call("echo", text="a" * 100 + "END"), call("boom"), call("echo")), given, {})
    first, second, third = (m["content"] for m in r.tool_messages)
    assert len(first) < 60 + 40 and "characters cut" in first and first.endswith("END")  # the end is kept
    assert second == "error: boom failed: KeyError: 'bug'"
    assert "at most 2 tool calls" in third and r.tool_errors == 2 and r.state == {"n": 6} and given == {"n": 5}
    with pytest.raises(ToolUnavailable):  # not the model's fault: the step fails (the worker replies ok=False)
        env.step(turn(call("down")), {}, {})


def test_registry_refuses_duplicates_and_names_the_known_ones():
    assert {"python", "calculator"} <= set(ENVIRONMENTS)
    with pytest.raises(ValueError, match="twice"):
        register_environment("python")(ToolEnvironment)
    with pytest.raises(KeyError, match="registered: .*calculator"):
        build_environment("no_such_env")


def test_settings_from_a_config_section():
    s = EnvSettings.from_config(OmegaConf.create({"tool_timeout_s": 2, "slots": 3, "max_output_chars": None}))
    assert s == EnvSettings(tool_timeout_s=2.0) and isinstance(s.tool_timeout_s, float)
    assert EnvSettings.from_config(None) == EnvSettings()
    with pytest.raises(ValueError, match="environment.memory_mb"):
        EnvSettings.from_config({"memory_mb": "lots"})
    with pytest.raises(ValueError, match="max_calls_per_turn must be > 0"):
        EnvSettings(max_calls_per_turn=0)


def test_a_plugin_file_registers_an_environment(tmp_path):
    from cascade_rl.environments.registry import PluginError, load_environments
    from cascade_rl.environments.registry import __doc__ as registry_doc

    plugin = tmp_path / "envs.py"
    plugin.write_text(registry_doc.split("::\n", 1)[1].replace("\n    ", "\n"))  # the docstring's example
    load_environments([str(plugin)])
    r = build_environment("shouting").step(turn(call("shout", text="hi")), {}, {})
    assert r.tool_messages == [{"role": "tool", "content": "HI"}] and r.state == {"shouts": 1}
    with pytest.raises(PluginError, match="environment.plugins: .*no such file"):
        load_environments([str(tmp_path / "missing.py")])


def test_run_step_turns_environment_failures_into_failed_replies():
    from cascade_rl.environments.steps import run_step
    from cascade_rl.environments.worker import build_environments

    class Raises:
        def step(self, messages, state, metadata):
            raise ToolUnavailable("sandbox down")

    class Unsendable:
        def step(self, messages, state, metadata):
            return StepResult(done=False, state={"obj": object()})

    req = EnvRequest(WorkKey.step("k", 0, "env", 0, 0), "e", "tool_use", turn("x"), deadline_s=5.0)
    down = run_step(Raises(), req, "w")
    assert not down.ok and "ToolUnavailable: sandbox down" in down.error and down.worker_id == "w"
    assert not run_step(Unsendable(), req).ok and "cannot be sent" in run_step(Unsendable(), req).error
    late = run_step(build_environment("calculator"), req, arrived=time.monotonic() - 10)
    assert not late.ok and "deadline" in late.error
    assert run_step(build_environment("calculator"), req).done
    with pytest.raises(ValueError, match=r"environment.serve names \['nope'\].*registered: .*python"):
        build_environments(["calculator", "nope"], EnvSettings())


# --------------------------------------------------------------------------- python tool, real sandbox

TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def python_env(tmp_path_factory) -> ToolEnvironment:
    state_dir = tmp_path_factory.mktemp("sandbox-state")
    state_dir.chmod(0o700)
    settings = EnvSettings(tool_timeout_s=TIMEOUT_S, memory_mb=256, max_processes=16)
    return ToolEnvironment(settings, {"python": PythonTool(settings, uid_base=UID_BASE, slots=SLOTS,
                                                           state_dir=str(state_dir))})


def sandbox_pids(grace_s: float = 5.0) -> list[int]:
    """The processes left under our uids, once the kernel has had ``grace_s`` to finish the sandbox's kills (a
    SIGKILLed process lingers until it is reaped; on a loaded machine that takes a moment)."""
    deadline = time.monotonic() + grace_s
    while True:
        pids = [pid for uid in range(UID_BASE, UID_BASE + SLOTS) for pid in sandbox.pids_of_uid(uid)]
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def run_code(env, code: str, state: dict | None = None) -> tuple[StepResult, str]:
    r = env.step(turn(call("python", code=code)), state or {}, {})
    assert r.tool_calls == 1 and len(r.tool_messages) == 1
    return r, r.tool_messages[0]["content"]


@needs_sandbox
def test_python_state_across_steps_by_replay(python_env):
    r1, out1 = run_code(python_env, "x = 41\nprint('setting x')")
    assert out1 == "setting x\n" and r1.state == {"cells": ["x = 41\nprint('setting x')"]} and r1.tool_errors == 0
    r2, out2 = run_code(python_env, "print(x + 1)", r1.state)
    assert out2 == "42\n" and len(r2.state["cells"]) == 2  # the first cell's print is not shown again
    assert len(r1.state["cells"]) == 1  # the state handed in is not changed
    _, out3 = run_code(python_env, "x * 2", r2.state)
    assert out3 == "82\n"  # a final bare expression shows its repr


@needs_sandbox
def test_python_a_failing_cell_is_shown_and_not_replayed(python_env):
    r1, _ = run_code(python_env, "x = 1")
    r2, out = run_code(python_env, "print('before')\nx = x / 0", r1.state)
    assert r2.tool_errors == 1 and r2.state == r1.state
    assert out.startswith("before\n") and "ZeroDivisionError" in out and '<cell 2>", line 2' in out
    assert "Traceback" in out and "json.loads" not in out  # the driver's frames are not shown
    r3, out3 = run_code(python_env, "print(x)", r2.state)
    assert out3 == "1\n" and r3.tool_errors == 0  # "before" is not printed again: cell 2 was dropped
    _, syntax = run_code(python_env, "def f(:")
    assert "SyntaxError" in syntax


@needs_sandbox
def test_python_a_hanging_cell_is_killed_at_its_deadline(python_env):
    t0 = time.monotonic()
    r, out = run_code(python_env, "while True: pass")
    assert time.monotonic() - t0 < TIMEOUT_S + 3
    assert out.startswith("error: timed out after 1.5s") and r.timeouts == 1 and r.tool_errors == 1
    assert r.state == {} and sandbox_pids() == []


@needs_sandbox
@pytest.mark.parametrize("code,reason", [("import os; os.kill(os.getpid(), 9)", "killed by signal 9 (SIGKILL)"),
                                         ("import ctypes; ctypes.string_at(0)", "killed by signal 11 (SIGSEGV)"),
                                         ("import os; os._exit(0)", "before it finished")])
def test_python_a_crashing_cell_gives_the_reason(python_env, code, reason):
    r, out = run_code(python_env, code)
    assert out.startswith("error: the cell") and reason in out and r.tool_errors == 1 and r.state == {}


@needs_sandbox
def test_python_a_fork_bomb_fails_closed_and_leaves_no_process(python_env):
    t0 = time.monotonic()
    r, out = run_code(python_env, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    # which of the sandbox's limits ends it first depends on the machine's load: its deadline, the process cap,
    # or the kill of the whole uid (SIGKILL); each fails the cell closed
    assert r.tool_errors == 1 and any(why in out for why in ("timed out", "Resource temporarily unavailable",
                                                             "killed by signal 9"))
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    assert sandbox_pids() == []
    _, plain = run_code(python_env, "import os\nwhile True: os.fork()")
    assert "BlockingIOError" in plain or "timed out" in plain
    assert sandbox_pids() == []
    _, ok = run_code(python_env, "print('still serving')")
    assert ok == "still serving\n"


@needs_sandbox
def test_python_memory_and_output_limits(python_env):
    _, out = run_code(python_env, "x = bytearray(1 << 30)")
    assert "MemoryError" in out
    r, out = run_code(python_env, "while True: print('a' * 1000)")
    assert r.tool_errors == 1 and len(out) < 2000 + 100 and out.rstrip().endswith("was stopped")


# --------------------------------------------------------------------------- the worker, a real process


@pytest.fixture
def worker(tmp_path):
    from cascade_rl.supervisor.config import compose

    cfg = compose("tiny", [f"run_dir={tmp_path}", "environment.slots=5", "environment.threads=2",
                           "environment.serve=[python,calculator]",
                           "supervisor.heartbeat_s=0.2"], check=False)
    cfg.endpoints.update({"orchestrator": f"ipc://{tmp_path}/orch", "heartbeat": f"ipc://{tmp_path}/hb"})
    config = tmp_path / "config.yaml"
    config.write_text(OmegaConf.to_yaml(cfg))
    ctx = zmq.Context.instance()
    router = bind_router(ctx, cfg.endpoints.orchestrator)
    beats = ctx.socket(zmq.PULL)
    beats.setsockopt(zmq.LINGER, 0)
    beats.bind(cfg.endpoints.heartbeat)
    log = open(tmp_path / "environment-t.log", "wb")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "cascade_rl.environments.worker", "--config", str(config),
                             "--worker-id", "environment-t"], stdout=log, stderr=log)
    yield router, beats, proc
    proc.kill()
    proc.wait()
    log.close()
    router.close(linger=0)
    beats.close(linger=0)


def receive(router, timeout_s: float = 30.0):
    assert router.poll(int(timeout_s * 1000)), "no reply from the environment worker"
    return recv_routed(router, (Ready, EnvReply))


@needs_sandbox
def test_worker_serves_steps_over_the_wire(worker):
    router, beats, proc = worker
    ident, ready = receive(router)
    assert isinstance(ready, Ready) and ready.role == "environment" and ready.slots == 5
    assert ready.domains == ["calculator", "python"]

    def step(group: str, after: int, env: str, text: str, state: dict | None = None) -> EnvReply:
        key = WorkKey.step(group, 0, "env", after, 0)
        send(router, EnvRequest(key, env, "tool_use", turn(text), state or {}, deadline_s=20.0), identity=ident)
        _, reply = receive(router)
        assert isinstance(reply, EnvReply) and reply.key == key and reply.worker_id == "environment-t"
        return reply

    first = step("g", 0, "python", call("python", code="x = 41"))
    assert first.ok and not first.done and first.state == {"cells": ["x = 41"]}
    second = step("g", 1, "python", call("python", code="print(x + 1)"), first.state)
    assert second.ok and second.tool_messages == [{"role": "tool", "content": "42\n"}] and second.tool_calls == 1
    assert step("g", 2, "python", "The answer is 42.", second.state).done
    unknown = step("u", 0, "no_such_env", call("python", code="1"))
    assert not unknown.ok and "no_such_env" in unknown.error and "python" in unknown.error
    calc = step("c", 0, "calculator", call("calculator", expression="x"))
    assert calc.ok and calc.tool_errors == 1

    t_end, counters = time.monotonic() + 10, {}
    while counters.get("steps", 0) < 5:
        assert time.monotonic() < t_end, f"heartbeat counters {counters}"
        if beats.poll(200):
            beat = recv(beats, (Heartbeat,))
            counters = beat.counters if beat.worker_id == "environment-t" else counters
    assert counters["tool_calls"] == 3 and counters["tool_errors"] == 1 and counters["failed"] == 1
    assert proc.poll() is None, "the environment worker died"
