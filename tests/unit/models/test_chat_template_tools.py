"""Multi-turn conversations with tool calls render as transformers' apply_chat_template does.

Two templates with tools, written after the real ones: Qwen2.5's (tools in the system turn as
JSON lines, calls as <tool_call> blocks, tool turns folded into a user turn of
<tool_response>s) and Llama 3.1's (tools in the first user turn as indented JSON, one call per
assistant turn as {"name", "parameters"}, tool turns as ipython turns, strings via tojson).
Tokenizers are built with `tokenizers` and saved by transformers (tests/unit/models/test_chat_template.py).
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

transformers = pytest.importorskip("transformers")

from slurm_align.environments.base import EnvironmentContext, checked_reset, step_all  # noqa: E402
from slurm_align.environments.config import EnvironmentConfig  # noqa: E402
from slurm_align.environments.tool_calls import assistant_message  # noqa: E402
from slurm_align.environments.tool_env import ToolEnvironment  # noqa: E402
from slurm_align.environments.tools import CalculatorTool, PythonTool  # noqa: E402
from slurm_align.models.tokenizer import HFTokenizer  # noqa: E402
from tests.unit.models.test_chat_template import CHATML_NAMES, LLAMA3_NAMES, make_tokenizer  # noqa: E402

QWEN25 = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud."
    " You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

LLAMA31 = (
    "{{- bos_token }}\n"
    "{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}\n{%- endif %}\n"
    "{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n{%- endif %}\n"
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n"
    "\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "\n"
    "{#- System message + builtin tools #}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{%- if builtin_tools is defined or tools is not none %}\n"
    "    {{- \"Environment: ipython\\n\" }}\n"
    "{%- endif %}\n"
    "{%- if builtin_tools is defined %}\n"
    "    {{- \"Tools: \" + builtin_tools | reject('equalto', 'code_interpreter') | join(\", \") + \"\\n\\n\"}}\n"
    "{%- endif %}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{%- if tools is not none and not tools_in_user_message %}\n"
    "    {{- \"You have access to the following functions. To call a function, please respond with JSON for a "
    "function call.\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n"
    "    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n        {{- \"\\n\\n\" }}\n    {%- endfor %}\n"
    "{%- endif %}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "\n"
    "{#- Custom tools are passed in a user message with some extra guidance #}\n"
    "{%- if tools_in_user_message and not tools is none %}\n"
    "    {#- Extract the first user message so we can plug it in here #}\n"
    "    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    "        {%- set messages = messages[1:] %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception(\"Cannot put tools in the first user message"
    " when there's no first user message!\") }}\n"
    "{%- endif %}\n"
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    "    {{- \"Given the following functions, please respond with a JSON for a function call \" }}\n"
    "    {{- \"with its proper arguments that best answers the given prompt.\\n\\n\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n"
    "    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n        {{- \"\\n\\n\" }}\n    {%- endfor %}\n"
    "    {{- first_user_message + \"<|eot_id|>\"}}\n"
    "{%- endif %}\n"
    "\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    "        {%- if not message.tool_calls|length == 1 %}\n"
    "            {{- raise_exception(\"This model only supports single tool-calls at once!\") }}\n"
    "        {%- endif %}\n"
    "        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "            {{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}\n"
    "            {%- for arg_name, arg_val in tool_call.arguments | items %}\n"
    "                {{- arg_name + '=\"' + arg_val + '\"' }}\n"
    "                {%- if not loop.last %}\n                    {{- \", \" }}\n                {%- endif %}\n"
    "            {%- endfor %}\n"
    "            {{- \")\" }}\n"
    "        {%- else  %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "            {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n"
    "            {{- '\"parameters\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- \"}\" }}\n"
    "        {%- endif %}\n"
    "        {%- if builtin_tools is defined %}\n"
    "            {#- This means we're in ipython mode #}\n"
    "            {{- \"<|eom_id|>\" }}\n"
    "        {%- else %}\n"
    "            {{- \"<|eot_id|>\" }}\n"
    "        {%- endif %}\n"
    "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"
    "        {{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}\n"
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n"
    "        {%- else %}\n"
    "            {{- message.content }}\n"
    "        {%- endif %}\n"
    "        {{- \"<|eot_id|>\" }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

TOOLS = [CalculatorTool().schema(), PythonTool().schema()]


def tool_call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


SINGLE_CALLS = [
    {"role": "user", "content": "What is 123 * 456?"},
    {"role": "assistant", "content": "", "tool_calls": [tool_call("calculator", {"expression": "123 * 456"})]},
    {"role": "tool", "name": "calculator", "content": "56088"},
    {"role": "assistant", "content": "It is 56088."},
    {"role": "user", "content": "And with <b>python</b> & \"quotes\"?"},
    {"role": "assistant", "content": None, "tool_calls": [tool_call("python", {"code": "print(123 * 456)\n"})]},
    {"role": "tool", "name": "python", "content": "56088\n"},
]
PARALLEL_CALLS = [
    {"role": "system", "content": "Use the tools. é ü"},
    {"role": "user", "content": "Compute 2**10 and 3**5."},
    {"role": "assistant", "content": "Two calls.", "tool_calls": [tool_call("calculator", {"expression": "2**10"}),
                                                                  tool_call("calculator", {"expression": "3**5"})]},
    {"role": "tool", "name": "calculator", "content": "1024"},
    {"role": "tool", "name": "calculator", "content": "243"},
    {"role": "assistant", "content": "1024 and 243."},
]
STYLES = {
    "qwen2.5": (QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, CHATML_NAMES),
    "llama3.1": (LLAMA31, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True},
                 [*LLAMA3_NAMES, "<|eom_id|>", "<|python_tag|>"]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tooltok")
    return {name: make_tokenizer(root / name, *spec) for name, spec in STYLES.items()}


def ids_of(ref, conv, **kw) -> list[int]:
    out = ref.apply_chat_template(conv, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


CASES = {
    "qwen2.5": [SINGLE_CALLS, SINGLE_CALLS[:3], PARALLEL_CALLS, PARALLEL_CALLS[:2]],
    "llama3.1": [SINGLE_CALLS, SINGLE_CALLS[:3], [PARALLEL_CALLS[0], *SINGLE_CALLS[:4]]],
}


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("gen_prompt", [False, True])
@pytest.mark.parametrize("tools", [TOOLS, None, []], ids=["tools", "no-tools", "empty-tools"])
def test_tool_conversations_render_as_transformers(folders, style, gen_prompt, tools):
    ref = transformers.AutoTokenizer.from_pretrained(folders[style])
    ours = HFTokenizer(folders[style])
    for conv in CASES[style]:
        want = ref.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=gen_prompt)
        got = ours.apply_chat_template(conv, tools=tools, add_generation_prompt=gen_prompt)
        assert got == want
        assert ours.encode(got) == ids_of(ref, conv, tools=tools, add_generation_prompt=gen_prompt)
    # the templates do render the tools and the calls (so the equality above covers them)
    text = ours.apply_chat_template(SINGLE_CALLS, tools=TOOLS)
    assert '"name": "calculator"' in text and "56088" in text
    if style == "qwen2.5":
        assert "<tools>\n" + '{"type": "function", "function": {"name": "calculator"' in text
        assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>' in text
        assert "<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>" in text
    else:
        assert '"parameters": {"expression": "123 * 456"}}<|eot_id|>' in text
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"56088"<|eot_id|>' in text


def test_template_errors_as_transformers(folders):
    ours = HFTokenizer(folders["llama3.1"])
    ref = transformers.AutoTokenizer.from_pretrained(folders["llama3.1"])
    with pytest.raises(jinja2.TemplateError, match="only supports single tool-calls"):
        ours.apply_chat_template(PARALLEL_CALLS, tools=TOOLS)
    with pytest.raises(jinja2.TemplateError, match="only supports single tool-calls"):
        ref.apply_chat_template(PARALLEL_CALLS, tools=TOOLS, tokenize=False)
    with pytest.raises(TypeError, match="must be a JSON schema dict"):
        ours.apply_chat_template(SINGLE_CALLS, tools=[CalculatorTool()])


def test_a_tool_environment_conversation_renders_as_transformers(folders):
    # what the tool environment produces (its tools, the model's turn as a structured message,
    # its tool turns) is a conversation both templates render as transformers does
    ctx = EnvironmentContext(EnvironmentConfig(environment="tools", tools=["calculator"], max_turns=3),
                             reward_rule="slurm_align.rewards.arithmetic:exact_answer")
    env = ToolEnvironment(ctx)
    try:
        row = {"prompt": "What is 123 * 456?", "answer": "56088"}
        conv = checked_reset(env, row)
        model_turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>'
        [r] = step_all(env, [([*conv, {"role": "assistant", "content": model_turn}], row)])
        conv = [*conv, assistant_message(model_turn), *r.messages, {"role": "assistant", "content": "56088"}]
        for style in STYLES:
            ref = transformers.AutoTokenizer.from_pretrained(folders[style])
            ours = HFTokenizer(folders[style])
            assert ours.apply_chat_template(conv, tools=env.tools()) == ref.apply_chat_template(
                conv, tools=env.tools(), tokenize=False)
        # Qwen2.5 renders the call exactly as the model wrote it
        text = HFTokenizer(folders["qwen2.5"]).apply_chat_template(conv, tools=env.tools())
        assert "<|im_start|>assistant\n" + model_turn + "<|im_end|>" in text
    finally:
        env.close()


def test_a_multi_turn_trajectory_reads_as_the_template_renders_the_conversation(folders):
    # the collector's trajectory text: the rendered prompt (with the tools), the model's turn as it
    # generated it (stopped at </tool_call>, no end-of-turn), then the environment's reply as
    # TurnRenderer writes it; equal to transformers' rendering of the whole conversation
    from slurm_align.environments.render import TurnRenderer
    for style in STYLES:
        ref = transformers.AutoTokenizer.from_pretrained(folders[style])
        r = TurnRenderer(HFTokenizer(folders[style]), TOOLS)
        conv = [{"role": "user", "content": "What is 123 * 456?"}]
        model_turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>'
        said = [*conv, {"role": "assistant", "content": model_turn}]
        reply = [{"role": "tool", "name": "calculator", "content": "56088"}]
        text = r._render(conv, True) + model_turn + r.reply_text(said, reply, chat=True)
        assert text == ref.apply_chat_template(said + reply, tools=TOOLS, tokenize=False, add_generation_prompt=True)
