"""Tool calls in model turns, the tool environment's error observations and worker pool, the
calculator (a safe evaluator) and the python tool's wiring (the sandbox itself:
unit/environments/test_sandbox.py)."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import load_run_config
from slurm_align.environments import calculator
from slurm_align.environments.base import EnvironmentContext, EnvironmentStepError, checked_reset, step_all
from slurm_align.environments.config import EnvironmentConfig, parse_environment_config
from slurm_align.environments.registry import load_environment
from slurm_align.environments.sandbox import SandboxLimits
from slurm_align.environments.tool_calls import BadCall, ToolCall, assistant_message, parse_tool_calls
from slurm_align.environments.tool_env import ToolEnvironment, ToolRunner
from slurm_align.environments.tools import CalculatorTool, Tool, check_arguments, load_tools
from slurm_align.rundir import RunDir, create_run_secret

HERE = "tests.unit.environments.test_tools"   # this module, named as user code names its tools
RULE = "slurm_align.rewards.arithmetic:exact_answer"
ROW = {"prompt": "123*456=", "answer": "56088"}
CEILING_S = 60.0    # generous bound on every event wait: the tests never rely on timing


def call(name: str, **arguments) -> str:
    import json
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- parsing -------------------------------------------------------------------------------------

def test_parse_calls_closed_open_and_head_text():
    text = "Let me compute. " + call("calculator", expression="1+2") + "\n" + '<tool_call>{"name": "python", ' \
           '"arguments": {"code": "print(1)"}}'      # the last block's </tool_call> was the stop sequence
    head, calls = parse_tool_calls(text)
    assert head == "Let me compute. "
    assert calls == [ToolCall("calculator", {"expression": "1+2"}), ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("The answer is 3.") == ("The answer is 3.", [])
    # arguments written as a JSON string are accepted as the object they hold
    assert parse_tool_calls('<tool_call>{"name": "c", "arguments": "{\\"x\\": 1}"}</tool_call>')[1] == [
        ToolCall("c", {"x": 1})]
    # Llama 3.1 writes {"name": ..., "parameters": ...}
    assert parse_tool_calls('<tool_call>{"name": "c", "parameters": {"x": 2}}</tool_call>')[1] == [
        ToolCall("c", {"x": 2})]
    msg = assistant_message("Let me compute. " + call("calculator", expression="1+2"))
    assert msg == {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}]}
    assert assistant_message("<tool_call>{oops</tool_call>") == {"role": "assistant",
                                                                 "content": "<tool_call>{oops</tool_call>"}


@pytest.mark.parametrize("body,match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"arguments": {}}', 'has no "name"'),
    ('{"name": "c", "arguments": [1]}', 'must be a JSON object, got list'),
    ('{"name": "c", "arguments": {}, "id": 3}', "has keys \\['arguments', 'id', 'name'\\]"),
    ('{"name": "c", "arguments": {}, "parameters": {}}', "expected \"name\" and \"arguments\""),
])
def test_bad_blocks_become_bad_calls(body, match):
    [bad] = parse_tool_calls(f"<tool_call>{body}</tool_call>")[1]
    assert isinstance(bad, BadCall)
    import re
    assert re.search(match, bad.problem)


def test_check_arguments_subset_of_json_schema():
    schema = {"type": "object", "required": ["n", "mode"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 10},
                             "mode": {"type": "string", "enum": ["a", "b"]},
                             "xs": {"type": "array", "items": {"type": "number"}}}}
    assert check_arguments(schema, {"n": 3, "mode": "a", "xs": [1, 2.5]}) == []
    assert check_arguments(schema, {"n": 3.0, "mode": "b"}) == []            # 3.0 is an integer in JSON
    assert check_arguments(schema, {"n": True, "mode": "a"}) == ["arguments.n must be integer, got bool True"]
    assert check_arguments(schema, {"n": 11, "mode": "c", "extra": 1, "xs": ["x"]}) == [
        "arguments.n must be at most 10, got 11", "arguments.mode must be one of ['a', 'b'], got 'c'",
        "arguments has unknown 'extra' (allowed: n, mode, xs)", "arguments.xs[0] must be number, got str 'x'"]
    assert check_arguments(schema, {}) == ["arguments misses required 'n'", "arguments misses required 'mode'"]
    assert check_arguments({**schema, "additionalProperties": True}, {"n": 1, "mode": "a", "other": 2}) == []


# -- calculator ----------------------------------------------------------------------------------

@pytest.mark.parametrize("expr,value", [
    ("123 * 456", 56088), ("2 ** 10", 1024), ("7 // 2", 3), ("-3 % 5", 2), ("(1 + 2) * 3", 9), ("1 / 4", 0.25),
    ("-(-2)", 2), ("+5 - 10", -5), ("2 ** -1", 0.5), ("1.5e3 + 0.5", 1500.5), ("999 * 999 * 999", 997002999),
])
def test_calculator_values(expr, value):
    assert calculator.evaluate(expr) == value and type(calculator.evaluate(expr)) is type(value)


@pytest.mark.parametrize("expr,match", [
    ("x + 1", "name 'x' is not allowed"),
    ("__import__('os').system('touch /tmp/calc_pwned')", "Call is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("'a' * 3", "str 'a' is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("(lambda: 1)()", "not allowed"),
    ("[1][0]", "not allowed"),
    ("True + 1", "bool True is not allowed"),
    ("1j * 2", "complex"),
    ("9 ** 9 ** 9", "too large"),
    ("2 ** 5000", "too large"),
    ("(10 ** 1000) * (10 ** 1000)", "too large"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("2.0 ** 5000", "overflows"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1+" * 600 + "1", "longer than 1000"),
    ("(" * 300 + "1" + ")" * 300, "nested too deeply|not an arithmetic"),
])
def test_calculator_refuses_everything_but_bounded_arithmetic(expr, match):
    with pytest.raises(calculator.CalculatorError, match=match):
        calculator.evaluate(expr)
    assert not Path("/tmp/calc_pwned").exists()


def test_calculator_tool_formats_values():
    tool = CalculatorTool()
    assert tool.run(expression="6 / 2") == "3" and tool.run(expression="1 / 3") == repr(1 / 3)
    assert tool.schema()["function"]["name"] == "calculator"


# -- the tool environment ------------------------------------------------------------------------

class Raising(Tool):
    name = "raising"

    def run(self) -> str:
        raise RuntimeError("tool broke")


class ReturnsNone(Tool):
    name = "returns_none"

    def run(self):
        return None


class Gate(Tool):
    """wait: blocks until open is called (or the ceiling); counts its runs."""

    name = "gate"
    parameters: ClassVar[dict[str, Any]] = {"type": "object",
                                            "properties": {"op": {"type": "string", "enum": ["wait", "open"]}},
                                            "required": ["op"]}

    def __init__(self):
        self.event, self.runs = threading.Event(), 0

    def run(self, op: str) -> str:
        self.runs += 1
        if op == "open":
            self.event.set()
            return "opened"
        return "passed" if self.event.wait(CEILING_S) else "ceiling"


def tool_env(instances: dict[str, Tool] | None = None, **settings) -> ToolEnvironment:
    """The tool environment of `settings` (its tools, or the given tool instances)."""
    settings = {"environment": "tools", "tools": ["calculator"], "max_turns": 4, **settings}
    ctx = EnvironmentContext(EnvironmentConfig(**settings), reward_rule=RULE)
    return ToolEnvironment(ctx, instances) if instances is not None else load_environment(ctx)


def turn(text: str, row=ROW, env=None):
    conv = [*checked_reset(env, row), {"role": "assistant", "content": text}]
    return conv


def test_calls_answers_and_the_final_reward():
    env = tool_env()
    try:
        assert isinstance(env, ToolEnvironment)
        assert [t["function"]["name"] for t in env.tools()] == ["calculator"]
        conv = turn("I will use the calculator. " + call("calculator", expression="123*456"), env=env)
        [r] = step_all(env, [(conv, ROW)])
        assert r.messages == [{"role": "tool", "name": "calculator", "content": "56088"}]
        assert not r.done and r.reward == 0.0 and r.metrics["tool_calls"] == 1 and r.metrics["tool_errors"] == 0
        conv += [*r.messages, {"role": "assistant", "content": "56088"}]
        [final] = step_all(env, [(conv, ROW)])
        assert final.done and final.reward == 1.0 and final.messages == [] and final.metrics == {"truncated": 0.0}
    finally:
        env.close()


def test_every_kind_of_bad_call_is_an_error_observation_and_the_run_goes_on():
    env = tool_env({"calculator": CalculatorTool(), "raising": Raising(), "returns_none": ReturnsNone()})
    try:
        text = ("<tool_call>{this is not json</tool_call>" + call("search", q="x") + call("calculator", expr="1")
                + call("calculator", expression="1/0") + call("raising") + call("returns_none")
                + call("calculator", expression="2+2"))
        [r] = step_all(env, [(turn(text, env=env), ROW)])
        contents = [m["content"] for m in r.messages]
        assert all(m["role"] == "tool" for m in r.messages) and len(contents) == 7
        assert contents[0].startswith("error: the tool call is not valid JSON")
        assert contents[1] == "error: unknown tool 'search'; the tools are: calculator, raising, returns_none"
        assert contents[2] == ("error: bad arguments for tool 'calculator': arguments misses required 'expression'; "
                               "arguments has unknown 'expr' (allowed: expression)")
        assert contents[3] == "error: tool 'calculator' raised CalculatorError: division by zero in 1 / 0"
        assert contents[4] == "error: tool 'raising' raised RuntimeError: tool broke"
        assert contents[5] == "error: tool 'returns_none' raised TypeError: returned NoneType, not text"
        assert contents[6] == "4"                                   # the good call still answers
        assert r.metrics["tool_calls"] == 7 and r.metrics["tool_errors"] == 6 and not r.done
    finally:
        env.close()


def test_rule_reward_errors_stop_naming_the_environment_and_row():
    env = tool_env()
    try:
        bad_row = {"prompt": "1+1="}                 # no 'answer' for the rule reward
        with pytest.raises(EnvironmentStepError, match=r"environment 'tools': the rule reward raised RuleRewardError"
                                                       r".*data row \{'prompt': '1\+1='\}"):
            step_all(env, [(turn("2", ROW, env), ROW), (turn("2", bad_row, env), bad_row)])
    finally:
        env.close()


def test_last_turn_ends_the_conversation_without_running_its_calls():
    gate = Gate()
    env = tool_env({"gate": gate}, max_turns=2)
    try:
        conv = turn(call("gate", op="open"), env=env)
        [r] = step_all(env, [(conv, ROW)])
        assert gate.runs == 1 and not r.done
        conv += [*r.messages, {"role": "assistant", "content": call("gate", op="open")}]
        [last] = step_all(env, [(conv, ROW)])
        assert last.done and last.reward == 0.0 and last.metrics == {"truncated": 1.0} and gate.runs == 1
    finally:
        env.close()


def test_calls_of_different_conversations_run_together_in_the_pool():
    # conversation A's call waits until conversation B's call opens the gate: run one after
    # another (A first) it would only pass at the ceiling; in the pool both answer at once
    gate = Gate()
    env = tool_env({"gate": gate}, tool_workers=2, tool_timeout_s=CEILING_S * 2)
    try:
        a, b = turn(call("gate", op="wait"), env=env), turn(call("gate", op="open"), env=env)
        ra, rb = step_all(env, [(a, ROW), (b, ROW)])
        assert ra.messages[0]["content"] == "passed" and rb.messages[0]["content"] == "opened"
    finally:
        env.close()


def test_a_stuck_call_times_out_and_does_not_hold_up_the_others():
    gate = Gate()
    env = tool_env({"gate": gate, "calculator": CalculatorTool()}, tool_workers=1, tool_timeout_s=0.2)
    try:
        # one worker: the stuck call takes it; when it is abandoned, a fresh pool runs the rest
        a, b = turn(call("gate", op="wait"), env=env), turn(call("calculator", expression="6*7"), env=env)
        ra, rb = step_all(env, [(a, ROW), (b, ROW)])
        assert ra.messages[0]["content"] == "error: tool 'gate' timed out after 0.2 s"
        assert ra.metrics["tool_timeouts"] == 1 and ra.metrics["tool_errors"] == 1
        assert rb.messages[0]["content"] == "42"
        [again] = step_all(env, [(b, ROW)])                  # the environment still works
        assert again.messages[0]["content"] == "42"
    finally:
        gate.event.set()     # release the abandoned thread
        env.close()


def test_runner_outcomes_in_order():
    runner = ToolRunner(workers=3, timeout_s=CEILING_S)
    try:
        outs = runner.run_all([lambda i=i: str(i) for i in range(10)])
        assert [o.text for o in outs] == [str(i) for i in range(10)] and all(o.ok for o in outs)
    finally:
        runner.close()


calculator_instance = CalculatorTool()


def test_tools_settings_and_user_tools():
    s = EnvironmentConfig(environment="tools", tools=["calculator", f"{HERE}:Raising", f"{HERE}:calculator_instance"],
                          max_turns=2)
    with pytest.raises(ConfigError,
                       match=r"environment.tools\[2\]': tool .* has name 'calculator', empty or already taken"):
        load_tools(s)
    s = EnvironmentConfig(environment="tools", tools=["python", f"{HERE}:Raising"], max_turns=2,
                          tool_timeout_s=5)
    tools = load_tools(s)
    assert list(tools) == ["python", "raising"] and tools["python"].limits.timeout_s == 4.5
    with pytest.raises(ConfigError, match=rf"environment.tools\[0\]': tool '{HERE}:ROW'.*has no Tool 'ROW'"):
        load_tools(EnvironmentConfig.model_construct(tools=[f"{HERE}:ROW"], tool_timeout_s=1))
    for data, match in [
        ({"tools": ["search"], "max_turns": 2},
         r"environment.tools'.*unknown tool 'search'; built-in: calculator, python"),
        ({"environment": "tools"}, r"environment 'tools' needs at least one tool"),
        ({"tools": ["calculator"]}, r"max_turns=1: the model could call a tool but never read its answer"),
        ({"tools": ["calculator", "calculator"], "max_turns": 2}, r"tools repeated"),
        ({"tool_timeout_s": 0}, r"environment.tool_timeout_s"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_environment_config(data)


def test_python_tool_runs_code_in_the_sandbox():
    env = tool_env(tools=["python"])
    try:
        code = "import os\nprint(sum(range(10)), os.getcwd().startswith(os.environ['HOME']))\nraise SystemExit(3)"
        [r] = step_all(env, [(turn(call("python", code=code), env=env), ROW)])
        assert r.messages[0]["content"] == "45 True\n\n[exit code 3]"
    finally:
        env.close()


def test_python_tool_hides_the_run_directory_from_the_code_it_runs():
    # The code's uid owns the run's files, as it does when a normal user runs the job (the usual
    # case on a cluster): here, as root, the files go to the sandbox's user, `nobody`. Uid alone
    # then keeps nothing from the code; only the hidden run directory does.
    # traversable by `nobody` (tmp_path is 0700), and outside /tmp (the sandbox's /tmp is its own)
    base = Path(tempfile.mkdtemp(prefix="python-tool-test-", dir="/var/tmp"))
    try:
        os.chmod(base, 0o755)
        rd = RunDir(base / "run")
        rd.root.mkdir()
        create_run_secret(rd)
        secret = rd.secret.read_text()
        if os.getuid() == 0:
            user = pwd.getpwnam(SandboxLimits().user)
            for p in (rd.root, rd.secret):
                os.chown(p, user.pw_uid, user.pw_gid)
        code = ("import os\n"
                f"print(sorted(os.listdir({str(rd.root)!r})))\n"
                f"try:\n    print(repr(open({str(rd.secret)!r}).read()))\n"
                "except OSError as e:\n    print(type(e).__name__)\n")
        run = load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", [
            f"run_dir={rd.root}", f"reward.rule={RULE}", "environment.environment=tools",
            "environment.tools=[python]", "environment.max_turns=2", "environment.tool_timeout_s=30"])

        def tool_output(ctx: EnvironmentContext) -> str:
            env = load_environment(ctx)
            try:
                [r] = step_all(env, [(turn(call("python", code=code), env=env), ROW)])
            finally:
                env.close()
            return r.messages[0]["content"]

        # without the run (no directory to hide) the same code reads the secret: the files are in reach
        unhidden = tool_output(EnvironmentContext(run.environment, reward_rule=RULE))
        assert secret in unhidden and "run.secret" in unhidden
        # the run's context (as the rollout collector builds it): the directory is an empty mount
        hidden = tool_output(EnvironmentContext.for_run(run))
        assert secret not in hidden and "run.secret" not in hidden
        refused = "[exit code 125]" in hidden and "cannot hide" in hidden     # no mount namespace on this kernel
        assert refused or hidden.splitlines() == ["[]", "FileNotFoundError"], hidden
    finally:
        shutil.rmtree(base, ignore_errors=True)
