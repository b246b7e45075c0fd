"""Tool-call formats that are not JSON in tags, on the tiny model's tokenizer: Llama 3's bare
JSON read from answers whole and streamed, and the grammars that hold `required` and named
calls to Llama 3's and Mistral's own formats, control tokens included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hotlora.config.errors import InvalidRequest
from hotlora.models.loader import load_model_dir
from hotlora.server.api.tool_calls import ToolCalls, ToolFormat
from hotlora.server.api.tool_families import family_grammar, llama3_format
from hotlora.server.engine import Engine

from tests.support.tiny import with_control_tokens, write_tiny_llama

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
# Enough of Llama 3.1's template for its format to be told: it shows tools and names the tag.
LLAMA3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>"
    "{{ message.role }}\n{% if message.tool_calls %}{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ message.content or '' }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{# built-in tools are called after <|python_tag|> #}"
)
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message.tool_calls %}[TOOL_CALLS]"
    "{{ message.tool_calls | tojson }}{% else %}{{ message.content or '' }}{% endif %}"
    "<|im_end|>{% endfor %}"
)
MISTRAL_ARGS_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "{{ message.tool_calls | tojson }}", "{{ call.name }}[ARGS]{{ call.arguments | tojson }}"
)


def engine_for(dir: Path) -> Engine:
    return Engine(load_model_dir(dir), base_id="tiny")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return engine_for(
        write_tiny_llama(tmp_path_factory.mktemp("llama3"), chat_template=LLAMA3_TEMPLATE)
    )


@pytest.fixture(scope="module", params=["text", "control tokens"])
def mistral(tmp_path_factory: pytest.TempPathFactory, request) -> Engine:
    dir = write_tiny_llama(tmp_path_factory.mktemp("mistral"), chat_template=MISTRAL_TEMPLATE)
    if request.param == "control tokens":
        with_control_tokens(dir, ["[TOOL_CALLS]", "[ARGS]"])
    return engine_for(dir)


@pytest.fixture(scope="module")
def mistral_args(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    dir = write_tiny_llama(tmp_path_factory.mktemp("args"), chat_template=MISTRAL_ARGS_TEMPLATE)
    return engine_for(with_control_tokens(dir, ["[TOOL_CALLS]", "[ARGS]"]))


def tool_calls(engine: Engine, parallel: bool = True) -> ToolCalls:
    form = ToolFormat.of(engine.tokenizer) or llama3_format(engine.tokenizer)
    assert form is not None
    return ToolCalls(form, TOOLS, parallel=parallel)


def accepts(engine: Engine, calls: ToolCalls, use: str, answer: str) -> bool:
    """Whether `answer`, then the end, is allowed by the family's grammar for `use`."""
    grammars = engine.grammars
    lark = family_grammar(calls, use, grammars.literal, grammars.json_rule)
    assert lark is not None
    constraint = grammars.tool_lark(lark).start()
    tokenizer = engine.tokenizer
    for token in [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]:
        constraint.consume(token)
        if constraint.error:
            return False
    return True


def test_the_formats_are_told_from_the_templates(llama3, mistral, mistral_args):
    assert tool_calls(llama3).format.family == "llama3"
    assert tool_calls(mistral).format.family == "mistral"
    assert tool_calls(mistral_args).format.family == "mistral_args"


LLAMA3_CALL = '{"name": "get_time", "parameters": {"zone": "UTC"}}'


@pytest.mark.parametrize(
    ("use", "answer", "allowed"),
    [
        ("required", LLAMA3_CALL, True),
        ("required", '{"name": "get_weather", "parameters": {"city": "Paris"}}', True),
        ("required", LLAMA3_CALL.replace("parameters", "arguments"), False),
        ("required", LLAMA3_CALL.replace("UTC", "PST"), False),
        ("required", "It is noon.", False),
        ("get_weather", LLAMA3_CALL, False),
        ("get_time", LLAMA3_CALL, True),
    ],
)
def test_llama3_calls_are_held_to_its_json(llama3, use, answer, allowed):
    assert accepts(llama3, tool_calls(llama3), use, answer) is allowed


def test_llama3_answers_are_read_whole_and_streamed(llama3):
    calls = tool_calls(llama3)
    text, [call] = calls.split(LLAMA3_CALL)
    assert text == "" and call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"zone": "UTC"}
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ' + (
        LLAMA3_CALL
    )
    assert [c.function.name for c in calls.split(tagged)[1]] == ["get_weather", "get_time"]
    plain = ["It is noon.", '{"zone": "UTC"}', '{"name": "nope", "parameters": {}}', "{"]
    plain += ['<|python_tag|>["get_time"]', '"get_time"', "123"]  # JSON, but no call object
    for answer in plain:
        assert calls.split(answer) == (answer, [])
    stream = calls.stream()
    assert stream.feed(" {") == ("", [])  # may be a call: held to the end
    assert stream.feed(LLAMA3_CALL[1:]) == ("", [])
    text, [call] = stream.flush()
    assert text == "" and stream.count == 1
    stream = calls.stream()
    assert stream.feed("<|py") == ("", []) and stream.feed("x") == ("<|pyx", [])


MISTRAL_CALLS = (
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, '
    '{"name": "get_weather", "arguments": {"city": "Paris"}}]'
)


@pytest.mark.parametrize(
    ("use", "parallel", "answer", "allowed"),
    [
        ("required", True, MISTRAL_CALLS, True),
        ("required", True, MISTRAL_CALLS.replace("[TOOL_CALLS] ", "[TOOL_CALLS]"), True),
        ("required", False, MISTRAL_CALLS, False),
        ("required", True, MISTRAL_CALLS.replace("[TOOL_CALLS] ", ""), False),
        ("required", True, MISTRAL_CALLS.replace("Paris", "Paris", 1).replace("UTC", "X"), False),
        ("get_time", True, MISTRAL_CALLS, False),
        ("get_time", False, MISTRAL_CALLS.split(", {")[0] + "]", True),
    ],
)
def test_mistral_calls_are_held_to_its_list(mistral, use, parallel, answer, allowed):
    calls = tool_calls(mistral, parallel)
    assert accepts(mistral, calls, use, answer) is allowed
    if allowed:
        text, read = calls.split(answer)
        assert (
            text == ""
            and read
            and all(c.function.name in ("get_time", "get_weather") for c in read)
        )


ARGS_CALLS = (
    '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
)


@pytest.mark.parametrize(
    ("use", "parallel", "answer", "allowed"),
    [
        ("required", True, ARGS_CALLS, True),
        ("required", False, ARGS_CALLS, False),
        ("required", False, ARGS_CALLS.split("[TOOL_CALLS]get_weather")[0], True),
        ("required", True, ARGS_CALLS.replace("CET", "PST"), False),
        ("get_weather", True, ARGS_CALLS, False),
        ("get_weather", True, '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', True),
    ],
)
def test_mistral_header_calls_are_held_to_their_form(mistral_args, use, parallel, answer, allowed):
    calls = tool_calls(mistral_args, parallel)
    assert accepts(mistral_args, calls, use, answer) is allowed
    if allowed:
        text, read = calls.split(answer)
        assert text == "" and read


def test_a_control_token_is_matched_as_itself(mistral_args):
    grammars = mistral_args.grammars
    [token] = mistral_args.tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)
    assert grammars.literal("[TOOL_CALLS]") == f"<[{token}]>"
    assert grammars.literal("get_time") == '"get_time"'


def test_formats_without_a_grammar_here_have_none(mistral):
    glm = ToolFormat(
        "<minimax:tool_call>", "</minimax:tool_call>", lambda b, t: {}, False, "minimax_m2"
    )
    grammars = mistral.grammars
    assert (
        family_grammar(ToolCalls(glm, TOOLS), "required", grammars.literal, grammars.json_rule)
        is None
    )


PYTHONIC_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    "{# calls: <|tool_call_start|>[name(key=value)]<|tool_call_end|> #}"
)
QWEN3_CODER_TEMPLATE = PYTHONIC_TEMPLATE.replace(
    "<|tool_call_start|>[name(key=value)]<|tool_call_end|>",
    "<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n</function>\n</tool_call>",
)
GLM_TEMPLATE = PYTHONIC_TEMPLATE.replace(
    "<|tool_call_start|>[name(key=value)]<|tool_call_end|>",
    "<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>",
)
# Arguments of every kind: a required string, an optional integer and an optional boolean.
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {
                "flag": {"type": "boolean"},
                "text": {"type": "string", "maxLength": 12},
                "count": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["text"],
        },
    },
}


@pytest.fixture(scope="module")
def pythonic(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    dir = write_tiny_llama(tmp_path_factory.mktemp("lfm"), chat_template=PYTHONIC_TEMPLATE)
    return engine_for(with_control_tokens(dir, ["<|tool_call_start|>", "<|tool_call_end|>"]))


@pytest.fixture(scope="module")
def qwen3_coder(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return engine_for(
        write_tiny_llama(tmp_path_factory.mktemp("coder"), chat_template=QWEN3_CODER_TEMPLATE)
    )


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return engine_for(write_tiny_llama(tmp_path_factory.mktemp("glm"), chat_template=GLM_TEMPLATE))


def read_one(engine: Engine, answer: str, parallel: bool = True) -> list[tuple[str, dict]]:
    calls = tool_calls(engine, parallel)
    calls = ToolCalls(calls.format, [*TOOLS, NOTE], parallel=parallel)
    text, read = calls.split(answer)
    assert text == ""
    return [(c.function.name, json.loads(c.function.arguments)) for c in read]


def allowed(engine: Engine, use: str, answer: str, parallel: bool = True) -> bool:
    form = tool_calls(engine).format
    return accepts(engine, ToolCalls(form, [*TOOLS, NOTE], parallel=parallel), use, answer)


PYTHONIC_CALLS = (
    '<|tool_call_start|>[note(text="a, b=c", count=3), get_time(zone="CET")]<|tool_call_end|>'
)


@pytest.mark.parametrize(
    ("use", "parallel", "answer", "ok"),
    [
        ("required", True, PYTHONIC_CALLS, True),
        ("required", False, PYTHONIC_CALLS, False),
        ("note", True, '<|tool_call_start|>[note(text="x", flag=true)]<|tool_call_end|>', True),
        (
            "note",
            True,
            '<|tool_call_start|>[note(text="x", flag=false, count=3)]<|tool_call_end|>',
            True,
        ),
        # In a fixed order: the required arguments, then the others as the schema lists them.
        (
            "note",
            True,
            '<|tool_call_start|>[note(text="x", count=3, flag=false)]<|tool_call_end|>',
            False,
        ),
        ("note", True, "<|tool_call_start|>[note(count=3)]<|tool_call_end|>", False),
        ("note", True, '<|tool_call_start|>[note(text="x", count=10)]<|tool_call_end|>', False),
        ("note", True, '<|tool_call_start|>[note(text="x", other=1)]<|tool_call_end|>', False),
        ("get_time", True, PYTHONIC_CALLS, False),
    ],
)
def test_pythonic_calls_are_held_to_their_form(pythonic, use, parallel, answer, ok):
    assert allowed(pythonic, use, answer, parallel) is ok
    if ok:
        assert [name for name, _ in read_one(pythonic, answer)]


def test_pythonic_calls_read_back_as_their_json(pythonic):
    assert read_one(pythonic, PYTHONIC_CALLS) == [
        ("note", {"text": "a, b=c", "count": 3}),
        ("get_time", {"zone": "CET"}),
    ]


CODER_CALL = (
    "<tool_call>\n<function=note>\n<parameter=text>\nhi there\n</parameter>\n"
    "<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize(
    ("use", "parallel", "answer", "ok"),
    [
        ("required", True, CODER_CALL, True),
        ("required", True, CODER_CALL + "\n" + CODER_CALL, True),
        ("required", False, CODER_CALL + "\n" + CODER_CALL, False),
        ("note", True, CODER_CALL.replace("hi there", "far too long a note"), False),
        ("note", True, CODER_CALL.replace("\n3\n", "\n12\n"), False),
        ("note", True, CODER_CALL.replace("<parameter=text>\nhi there\n</parameter>\n", ""), False),
        (
            "get_time",
            True,
            "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
            "</tool_call>",
            True,
        ),
        ("get_time", True, CODER_CALL, False),
    ],
)
def test_qwen3_coder_calls_are_held_to_their_form(qwen3_coder, use, parallel, answer, ok):
    assert allowed(qwen3_coder, use, answer, parallel) is ok


def test_qwen3_coder_calls_read_back_typed(qwen3_coder):
    assert read_one(qwen3_coder, CODER_CALL) == [("note", {"text": "hi there", "count": 3})]


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"x": {"type": "string", "pattern": "^a+$"}}},
        {"type": "object", "properties": {"x": {"type": "string", "maxLength": "6}/ | /x"}}},
        {"type": "object", "properties": {"x": {"anyOf": [{"type": "string"}]}}},
        {"anyOf": [{"type": "object"}]},
        {"type": "object", "properties": [1]},
        {"type": "object", "properties": {"x": {"type": "string"}}, "required": 5},
        {"type": "object", "properties": {"x": {"type": "string"}}, "required": [["x"]]},
    ],
)
def test_arguments_a_raw_format_cannot_hold_are_refused(qwen3_coder, parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    calls = ToolCalls(tool_calls(qwen3_coder).format, [tool])
    grammars = qwen3_coder.grammars
    with pytest.raises(InvalidRequest) as caught:
        family_grammar(calls, "required", grammars.literal, grammars.json_rule)
    assert (caught.value.param, caught.value.code) == ("tools", "invalid_function_parameters")


GLM_CALL = (
    "<tool_call>note<arg_key>text</arg_key><arg_value>hi there</arg_value>"
    "<arg_key>count</arg_key><arg_value>3</arg_value></tool_call>"
)
GLM45_CALL = (
    "<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>hi there</arg_value>\n"
    "<arg_key>flag</arg_key>\n<arg_value>true</arg_value>\n</tool_call>"
)


@pytest.mark.parametrize(
    ("use", "parallel", "answer", "ok"),
    [
        ("required", True, GLM_CALL, True),
        ("required", True, GLM45_CALL, True),
        ("required", True, GLM_CALL + GLM45_CALL, True),
        ("required", False, GLM_CALL + GLM45_CALL, False),
        ("note", True, GLM_CALL.replace(">3<", ">x<"), False),
        ("note", True, GLM_CALL.replace("hi there", "a note far too long"), False),
        ("get_time", True, GLM_CALL, False),
        (
            "get_time",
            True,
            "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>",
            True,
        ),
    ],
)
def test_glm_calls_are_held_to_their_form(glm, use, parallel, answer, ok):
    assert allowed(glm, use, answer, parallel) is ok


def test_glm_calls_read_back_typed(glm):
    assert read_one(glm, GLM_CALL) == [("note", {"text": "hi there", "count": 3})]
    assert read_one(glm, GLM45_CALL) == [("note", {"text": "hi there", "flag": True})]


FUNCTION_GEMMA_TOKENS = ["<start_function_call>", "<end_function_call>", "<escape>"]
GEMMA4_TOKENS = ["<|tool_call>", "<tool_call|>", '<|"|>']


@pytest.fixture(scope="module", params=["function_gemma", "function_gemma as text", "gemma4"])
def gemma(tmp_path_factory: pytest.TempPathFactory, request) -> Engine:
    family = request.param.split()[0]
    tokens = FUNCTION_GEMMA_TOKENS if family == "function_gemma" else GEMMA4_TOKENS
    template = PYTHONIC_TEMPLATE.replace(
        "<|tool_call_start|>[name(key=value)]<|tool_call_end|>", " ".join(tokens)
    )
    dir = write_tiny_llama(tmp_path_factory.mktemp(family), chat_template=template)
    if not request.param.endswith("as text"):
        with_control_tokens(dir, tokens)
    engine = engine_for(dir)
    assert tool_calls(engine).format.family == family
    return engine


def gemma_call(engine: Engine, body: str) -> str:
    """`call:...` between the family's marks, its strings between its quotes (`'` here)."""
    start, end, quote = (
        FUNCTION_GEMMA_TOKENS
        if tool_calls(engine).format.family == "function_gemma"
        else GEMMA4_TOKENS
    )
    return start + body.replace("'", quote) + end


@pytest.mark.parametrize(
    ("use", "parallel", "body", "ok"),
    [
        ("required", True, "call:note{text:'hi there',count:3}", True),
        ("note", True, "call:note{text:'hi',flag:true,count:0}", True),
        ("note", True, "call:note{count:3}", False),  # text is required
        ("note", True, "call:note{text:'far too long a note'}", False),
        ("note", True, "call:note{text:'a}b'}", False),
        ("get_time", True, "call:get_time{zone:'CET'}", True),
        ("get_time", True, "call:get_time{zone:'PST'}", False),
    ],
)
def test_gemma_calls_are_held_to_their_form(gemma, use, parallel, body, ok):
    assert allowed(gemma, use, gemma_call(gemma, body), parallel) is ok


def test_gemma_calls_read_back_typed(gemma):
    answer = gemma_call(gemma, "call:note{text:'hi there',flag:false,count:3}")
    assert read_one(gemma, answer) == [("note", {"text": "hi there", "flag": False, "count": 3})]
    two = answer + gemma_call(gemma, "call:get_time{zone:'UTC'}")
    assert allowed(gemma, "required", two) and not allowed(gemma, "required", two, False)
