"""Chat templates and the tokens that end a generation: the built-ins render as their families do,
`--chat-template` takes a name, a file or the text and refuses a bad one at start-up, a model
without a template gets its family's, and the end-of-generation set is llama.cpp's."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hotlora.models.end_of_generation import CONFIG, EOS, NAME, TEMPLATE
from hotlora.models.gguf import import_gguf, read_header
from hotlora.models.loader import LoadedModel, load_model_dir
from hotlora.server.cli import build_parser, main, serve_settings
from hotlora.server.render.chat_prompt import ChatTemplate
from hotlora.server.render.chat_templates import (
    BUILTINS,
    ChatTemplateError,
    family_template,
    for_replicas,
    install_chat_template,
    read_chat_template,
)

from tests.support.gguf_files import embedded_gguf
from tests.support.turn_models import (
    CONVERSATION,
    NO_MARKERS,
    RENDERED,
    TURN_FAMILIES,
    TurnFamily,
    write_turn_gguf,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each turn family's tiny model, and the one without markers (`none`), imported."""
    root = tmp_path_factory.mktemp("turns")
    dirs = {}
    for name, turn in {**TURN_FAMILIES, "none": NO_MARKERS}.items():
        dirs[name] = import_gguf(write_turn_gguf(root / f"{name}.gguf", turn), root / name)
    return dirs


def load(path: Path, setting: str | None = None) -> LoadedModel:
    loaded = load_model_dir(path)
    install_chat_template(loaded, setting)
    return loaded


def ids(loaded: LoadedModel, *tokens: str) -> list[int]:
    return [loaded.tokenizer.convert_tokens_to_ids(token) for token in tokens]


def render(loaded: LoadedModel, messages: list[dict[str, Any]], prompt: bool = True) -> str:
    text = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=prompt, tokenize=False
    )
    assert isinstance(text, str)
    return text


# --- the built-ins ----------------------------------------------------------------------------


def test_every_builtin_is_tested():
    assert set(RENDERED) == set(BUILTINS)


@pytest.mark.parametrize("name", BUILTINS)
def test_each_builtin_renders_as_its_family_does(name: str, model_dirs: dict[str, Path]):
    loaded = load(model_dirs["none"], name)
    assert render(loaded, CONVERSATION) == RENDERED[name]


def test_the_smollm2_builtin_is_the_embedded_models_own(model_dirs: dict[str, Path], tmp_path):
    own = read_header(embedded_gguf()).metadata["tokenizer.chat_template"]
    (tmp_path / "own.jinja").write_text(own)
    builtin, embedded = load(model_dirs["none"], "smollm2"), load(model_dirs["none"])
    conversations = [CONVERSATION, CONVERSATION[1:], CONVERSATION[1:2]]
    for messages in conversations:
        embedded.use_chat_template(own)
        expected = render(embedded, messages)
        assert render(builtin, messages) == expected
    assert "You are a helpful AI assistant named SmolLM" in render(builtin, CONVERSATION[1:2])


def test_a_file_and_the_text_itself_are_templates_too(model_dirs: dict[str, Path], tmp_path):
    text = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "mine.jinja").write_text(text)
    for setting in (str(tmp_path / "mine.jinja"), text):
        loaded = load(model_dirs["gemma"], setting)
        assert render(loaded, CONVERSATION[1:3]) == "[user] Hi\n[assistant] Hello!\n"


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (
            "chatlm",
            "chatlm is neither a built-in template (chatml, gemma, llama3, mistral, phi3, "
            "smollm2) nor a file",
        ),
        ("missing.jinja", "missing.jinja is neither a built-in template"),
        (
            "{{ messages",
            "the template given: not a valid Jinja template: unexpected end of template",
        ),
        ("bad.jinja", "bad.jinja: not a valid Jinja template: Encountered unknown tag 'endfor'"),
        (
            "{{ messages | nosuchfilter }}",
            "the template given: not a valid Jinja template: No filter named 'nosuchfilter'",
        ),
        (".", ".: cannot be read as a text file"),
    ],
)
def test_a_bad_value_is_refused_with_what_is_wrong(value: str, problem: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jinja").write_text("{% endfor %}")
    with pytest.raises(ChatTemplateError) as refused:
        read_chat_template(value)
    assert str(refused.value).startswith(problem)


def test_a_file_travels_to_ray_replicas_as_its_text(tmp_path):
    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    assert for_replicas(str(tmp_path / "mine.jinja")) == "{{ messages[0]['content'] }}"
    assert for_replicas("gemma") == "gemma"
    assert for_replicas(None) is None


def test_ray_replicas_get_the_template_file_as_text(tmp_path):
    pytest.importorskip("ray")
    from hotlora.config.settings import Settings
    from hotlora.server.ray.serve_app import settings_data

    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    data = settings_data(Settings(chat_template=str(tmp_path / "mine.jinja")))
    assert data["chat_template"] == "{{ messages[0]['content'] }}"
    assert Settings(**data).chat_template == "{{ messages[0]['content'] }}"


# --- a model without a template ---------------------------------------------------------------


@pytest.mark.parametrize("name", TURN_FAMILIES)
def test_a_model_without_a_template_gets_its_familys(name: str, model_dirs, caplog):
    turn = TURN_FAMILIES[name]
    caplog.set_level(logging.INFO, logger="hotlora")
    loaded = load(model_dirs[name])
    expected = load(model_dirs[name], turn.template)
    assert render(loaded, CONVERSATION[1:]) == render(expected, CONVERSATION[1:])
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "hotlora"]
    assert len(warned) == 1
    assert f"the built-in '{turn.template}' template" in warned[0].getMessage()
    assert "--chat-template NAME|FILE" in warned[0].getMessage()


def test_a_family_with_no_fitting_builtin_stays_without_one(model_dirs, caplog):
    caplog.set_level(logging.WARNING, logger="hotlora")
    loaded = load(model_dirs["none"])
    assert not loaded.tokenizer.has_chat_template
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "hotlora"]
    assert "no chat template" in warning and "--chat-template NAME|FILE" in warning


def test_a_model_with_its_own_template_keeps_it(model_dirs, tmp_path, caplog):
    own_dir = tmp_path / "own-template"
    shutil.copytree(model_dirs["none"], own_dir)
    config = json.loads((own_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'own:' + messages[0]['content'] }}"
    (own_dir / "tokenizer_config.json").write_text(json.dumps(config))
    caplog.set_level(logging.INFO, logger="hotlora")
    assert render(load(own_dir), CONVERSATION[1:2]) == "own:Hi"
    assert [r for r in caplog.records if r.name == "hotlora"] == []
    assert render(load(own_dir, "chatml"), CONVERSATION[1:2]).startswith("<|im_start|>user")
    said, warned = [r for r in caplog.records if r.name == "hotlora"]
    assert said.getMessage() == (
        "chat template: 'chatml' (--chat-template), in place of the model's own"
    )
    assert warned.getMessage().startswith("the built-in 'chatml' chat template writes turn")


def test_a_builtin_whose_turn_markers_the_vocabulary_lacks_is_served_with_a_warning(
    model_dirs, caplog
):
    caplog.set_level(logging.WARNING, logger="hotlora")
    gemma = model_dirs["gemma"]
    assert "<start_of_turn>user" in render(load(gemma, "gemma"), CONVERSATION[1:2])
    assert [r for r in caplog.records if r.name == "hotlora"] == []  # its own family's fits
    assert "<|start_header_id|>user" in render(load(gemma, "llama3"), CONVERSATION[1:2])
    (said,) = [r.getMessage() for r in caplog.records if r.name == "hotlora"]
    assert said.startswith(
        "the built-in 'llama3' chat template writes turn markers this model's vocabulary has no "
        "token for (<|start_header_id|>, <|end_header_id|>, <|eot_id|>)"
    )


@pytest.mark.parametrize(
    ("model_type", "vocabulary", "template"),
    [
        ("llama", {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}, "llama3"),
        ("llama", {"<|im_start|>", "<|im_end|>"}, "chatml"),
        ("llama", {"[INST]", "[/INST]"}, "mistral"),
        ("llama", {"<s>", "</s>"}, None),
        ("mistral", {"<s>", "</s>"}, "mistral"),
        ("qwen2", {"<|im_start|>", "<|im_end|>"}, "chatml"),
        ("qwen3", {"<|endoftext|>"}, None),
        ("gemma2", {"<start_of_turn>", "<end_of_turn>"}, "gemma"),
        ("phi3", {"<|user|>", "<|assistant|>", "<|end|>"}, "phi3"),
        ("starcoder2", {"<|im_start|>", "<|im_end|>"}, None),
    ],
)
def test_a_familys_builtin_fits_its_vocabulary(model_type, vocabulary, template):
    assert family_template(model_type, vocabulary) == template


# --- the tokens that end a generation ---------------------------------------------------------


@pytest.mark.parametrize("name", TURN_FAMILIES)
def test_the_end_of_turn_ends_a_generation_beside_eos(name: str, model_dirs):
    turn: TurnFamily = TURN_FAMILIES[name]
    loaded = load(model_dirs[name])
    (eos,) = ids(loaded, turn.eos or "</s>")
    (end,) = ids(loaded, turn.end_of_turn or "")
    assert end != eos
    assert loaded.end_of_generation[eos][:2] == (EOS, CONFIG)
    assert loaded.end_of_generation[end] == (NAME, TEMPLATE)
    assert loaded.tokenizer.eos_token_ids == set(loaded.end_of_generation)


def test_llama3s_end_of_message_ends_a_generation_too(model_dirs):
    loaded = load(model_dirs["llama3"])
    (eom,) = ids(loaded, "<|eom_id|>")
    assert loaded.end_of_generation[eom] == (NAME,)


def test_every_id_of_generation_config_ends_a_generation(model_dirs, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(model_dirs["none"], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 40, 41]}))
    loaded = load(path)
    assert {i: loaded.end_of_generation[i] for i in (40, 41)} == {40: (CONFIG,), 41: (CONFIG,)}
    assert {2, 40, 41} <= loaded.tokenizer.eos_token_ids


def test_the_templates_own_end_marker_ends_a_generation(model_dirs):
    """A special token no known name spells, which the template closes a turn with."""
    loaded = load(model_dirs["chatml"])
    (start,) = ids(loaded, "<|im_start|>")
    assert start not in loaded.end_of_generation
    loaded.use_chat_template(
        "{% for m in messages %}{{ m['content'] + '<|im_start|>' }}{% endfor %}"
    )
    assert loaded.end_of_generation[start] == (TEMPLATE,)


def test_plain_text_after_a_turn_is_no_marker(model_dirs):
    loaded = load(model_dirs["none"], "{% for m in messages %}{{ m['content'] }}\n###{% endfor %}")
    assert set(loaded.end_of_generation) == set(ids(loaded, "</s>"))


def test_the_embedded_models_set(embedded_model_dir):
    loaded = load(embedded_model_dir)
    assert loaded.end_of_generation == {
        0: (NAME,),  # <|endoftext|>
        2: (EOS, CONFIG, NAME, TEMPLATE),  # <|im_end|>
    }


# --- at start-up ------------------------------------------------------------------------------


@pytest.fixture
def no_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("HOTLORA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr("hotlora.server.app.create_app", lambda *a, **k: pytest.fail("served"))


@pytest.mark.parametrize(
    ("flags", "variables", "toml", "line"),
    [
        (
            ["--chat-template", "chatlm"],
            {},
            None,
            "--chat-template: chatlm is neither a built-in template (chatml, gemma, llama3, "
            "mistral, phi3, smollm2) nor a file",
        ),
        (
            [],
            {"HOTLORA_CHAT_TEMPLATE": "gone.jinja"},
            None,
            "HOTLORA_CHAT_TEMPLATE: gone.jinja is neither a built-in template (chatml, gemma, "
            "llama3, mistral, phi3, smollm2) nor a file",
        ),
        (
            [],
            {},
            'chat_template = "bad.jinja"',
            "{file}: chat_template: bad.jinja: not a valid Jinja template: unexpected '}' (line 1)",
        ),
    ],
)
def test_a_bad_template_stops_the_start_with_one_line(
    flags, variables, toml, line, tmp_path, monkeypatch, capsys, no_variables
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jinja").write_text("{{ messages }")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if toml is not None:
        (tmp_path / "hotlora.toml").write_text(toml + "\n")
        flags = [*flags, "--config", str(tmp_path / "hotlora.toml")]
    assert main(["serve", *flags]) == 2
    expected = "hotlora serve: " + line.replace("{file}", str(tmp_path / "hotlora.toml"))
    assert capsys.readouterr().err == expected + "\n"


def test_a_good_template_passes_the_start(tmp_path, no_variables):
    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    for value in ("llama3", str(tmp_path / "mine.jinja")):
        args = build_parser().parse_args(["serve", "--chat-template", value])
        assert serve_settings(args).chat_template == value


def test_developer_messages_reach_a_template_that_names_the_role_as_sent():
    developer = {"role": "developer", "content": "Be brief."}
    user = {"role": "user", "content": "hi"}
    conversation = [developer, user]
    names_it = SimpleNamespace(chat_template="{% if m.role == 'developer' %}{% endif %}")
    assert ChatTemplate(names_it).with_roles(conversation) == conversation
    chatml = ChatTemplate(SimpleNamespace(chat_template=read_chat_template("chatml")))
    assert chatml.with_roles(conversation) == [{**developer, "role": "system"}, user]
    assert developer["role"] == "developer"  # the request's own messages are left as sent
