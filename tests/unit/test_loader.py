"""Loading a model directory: the tiny llama loads, broken directories are refused clearly."""

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from hotlora.models.dialects import UnsupportedConfig
from hotlora.models.loader import (
    DEFAULT_CONTEXT_LENGTH,
    MAX_CONTEXT_LENGTH,
    LoadedModel,
    ModelLoadError,
    generation_defaults,
    load_model_dir,
)

from tests.support.tiny import (
    ENDOFTEXT_ID,
    EOS_TOKEN_ID,
    MAX_POSITION_EMBEDDINGS,
    VOCAB_SIZE,
    is_quantized,
    write_tiny_llama,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def loaded(tiny_dir) -> LoadedModel:
    return load_model_dir(tiny_dir)


def edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_tiny_llama_loads_and_gives_logits(loaded, tiny_dir):
    tokens = loaded.tokenizer.encode("the cat sat")
    logits = loaded.model(mx.array([tokens]))
    assert logits.shape == (1, len(tokens), VOCAB_SIZE)
    assert loaded.path == tiny_dir
    assert not is_quantized(loaded.model)
    assert loaded.context_length == MAX_POSITION_EMBEDDINGS


def test_the_dialect_read_config_is_what_the_model_is_built_from(loaded):
    assert loaded.config["layer_types"] == ["full_attention", "full_attention"]
    assert loaded.config["rope_parameters"]["full_attention"]["rope_theta"] == 10000
    assert loaded.model.args.layer_types == ["full_attention", "full_attention"]


def test_a_transformers5_rope_map_reaches_llama_as_its_flat_theta(tmp_path):
    path = write_tiny_llama(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    (path / "config.json").write_text(json.dumps(config))
    model = load_model_dir(path).model
    # mlx-lm's llama ignores rope_parameters; without the dialect it would use 10000.
    assert model.model.layers[0].self_attn.rope.base == 5000.0


def test_tokenizer_round_trips_and_applies_the_chat_template(loaded):
    tokenizer = loaded.tokenizer
    text = "Hello, world!\n\tThe answer is 42."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # <|im_end|> (eos) and <|endoftext|>, which ends a generation by its name, as llama.cpp has it.
    assert tokenizer.eos_token_ids == {EOS_TOKEN_ID, ENDOFTEXT_ID}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert EOS_TOKEN_ID in ids
    assert tokenizer.decode(list(range(VOCAB_SIZE)))  # every id decodes


def test_generation_config_eos_ids_are_respected(tmp_path):
    path = write_tiny_llama(tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_model_dir(path).tokenizer.eos_token_ids == {0, 2}


def test_quantized_copy_loads_as_quantized(tmp_path):
    loaded = load_model_dir(write_tiny_llama(tmp_path / "q", quantize=True))
    assert is_quantized(loaded.model)
    logits = loaded.model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, VOCAB_SIZE)


def test_same_seed_writes_the_same_weights(tmp_path):
    a = load_model_dir(write_tiny_llama(tmp_path / "a")).model(mx.array([[5, 6]]))
    b = load_model_dir(write_tiny_llama(tmp_path / "b")).model(mx.array([[5, 6]]))
    assert mx.array_equal(a, b)


def break_missing_dir(path: Path) -> Path:
    return path / "nowhere"


def break_file_not_dir(path: Path) -> Path:
    return path / "config.json"


def break_no_config(path: Path) -> Path:
    (path / "config.json").unlink()
    return path


def break_no_weights(path: Path) -> Path:
    (path / "model.safetensors").unlink()
    return path


def break_bad_json(path: Path) -> Path:
    (path / "config.json").write_text("{not json")
    return path


def break_no_model_type(path: Path) -> Path:
    edit_config(path, model_type=None)
    return path


def break_unknown_type(path: Path) -> Path:
    edit_config(path, model_type="made_up_arch")
    return path


def break_diffusion_gemma(path: Path) -> Path:
    edit_config(path, model_type="diffusion_gemma")
    return path


def break_no_tokenizer(path: Path) -> Path:
    (path / "tokenizer.json").unlink()
    (path / "tokenizer_config.json").unlink()
    return path


def break_weights_mismatch(path: Path) -> Path:
    edit_config(path, hidden_size=32)
    return path


def break_config_list(path: Path) -> Path:
    (path / "config.json").write_text("[1, 2]")
    return path


def break_heads_zero(path: Path) -> Path:
    edit_config(path, num_attention_heads=0)
    return path


def break_layers_text(path: Path) -> Path:
    edit_config(path, num_hidden_layers="2")
    return path


def break_layers_past_the_weights(path: Path) -> Path:
    edit_config(path, num_hidden_layers=2**40)
    return path


def break_weights_empty(path: Path) -> Path:
    (path / "model.safetensors").write_bytes(b"")
    return path


def break_weights_cut_short(path: Path) -> Path:
    whole = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    return path


def break_weight_missing(path: Path) -> Path:
    weights = mx.load(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def break_quantized_without_its_section(path: Path) -> Path:
    quantized = write_tiny_llama(path.parent / "q", quantize=True)
    (path / "model.safetensors").write_bytes((quantized / "model.safetensors").read_bytes())
    return path


BROKEN_DIRS = [
    (break_missing_dir, "does not exist"),
    (break_file_not_dir, "is neither a model directory nor a GGUF file"),
    (break_no_config, "has no config.json"),
    (break_no_weights, "has no model*.safetensors"),
    (break_bad_json, "is not valid JSON"),
    (break_no_model_type, "does not name a model_type"),
    (break_unknown_type, "'made_up_arch' is not an architecture mlx-lm can build"),
    (break_diffusion_gemma, "'diffusion_gemma' is not an architecture mlx-lm can build"),
    (
        break_no_tokenizer,
        "cannot load the tokenizer: the directory has no tokenizer files (tokenizer.json, "
        "tokenizer.model, vocab.json); copy the model's into it",
    ),
    (break_weights_mismatch, "cannot build the 'llama' model"),
    (
        break_config_list,
        "config.json holds a JSON list, not an object of settings; it should be the model's "
        "own config.json",
    ),
    (break_heads_zero, "config.json: num_attention_heads is 0, not a whole number above 0"),
    (break_layers_text, "config.json: num_hidden_layers is '2', not a whole number above 0"),
    (
        break_layers_past_the_weights,
        "config.json: num_hidden_layers is 1,099,511,627,776, but the weights hold 2 layers",
    ),
    (
        break_weights_empty,
        "model.safetensors is 0 bytes long, too short for a safetensors header; download or "
        "write it again",
    ),
    (break_weights_cut_short, "model.safetensors is cut short: its tensors run past the end"),
    (
        break_weight_missing,
        "cannot build the 'llama' model: Missing 1 parameters: model.layers.1.mlp.down_proj.weight",
    ),
    (
        break_quantized_without_its_section,
        "cannot build the 'llama' model: Received 30 parameters not in model: ",
    ),
]


@pytest.mark.parametrize(
    ("breakage", "message"), BROKEN_DIRS, ids=lambda c: getattr(c, "__name__", "")
)
def test_broken_directories_are_refused_clearly(tmp_path, breakage, message):
    """Each in one line naming the directory or its file, whatever the library said."""
    path = breakage(write_tiny_llama(tmp_path / "m"))
    with pytest.raises(ModelLoadError, match=re.escape(message)) as refused:
        load_model_dir(path)
    assert "\n" not in str(refused.value)
    assert str(path) in str(refused.value)


def test_quantized_weights_without_their_section_say_so_in_one_line(tmp_path):
    path = break_quantized_without_its_section(write_tiny_llama(tmp_path / "m"))
    with pytest.raises(ModelLoadError) as refused:
        load_model_dir(path)
    assert str(refused.value).endswith(
        " and 27 more (quantized weights: config.json needs its quantization section)"
    )


def test_a_quantized_weight_missing_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "m", quantize=True)
    weights = mx.load(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError) as refused:
        load_model_dir(path)
    assert str(refused.value) == (
        f"{path}: cannot build the 'llama' model: the weights have no "
        "model.layers.1.mlp.down_proj.weight"
    )


def test_an_unverified_value_is_refused_at_load_with_its_field(tmp_path):
    path = write_tiny_llama(tmp_path / "m")
    edit_config(path, model_type="qwen3_5", output_gate_type="sigmoid")
    with pytest.raises(ModelLoadError, match="output_gate_type='sigmoid'") as refused:
        load_model_dir(path)
    assert isinstance(refused.value.__cause__, UnsupportedConfig)


def loaded_with(config: dict, model_max_length=None) -> LoadedModel:
    tokenizer = SimpleNamespace(model_max_length=model_max_length)
    return LoadedModel(model=None, tokenizer=tokenizer, config=config, path=Path("."))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "model_max_length", "expected"),
    [
        ({"text_config": {"max_position_embeddings": 8192}, "n_ctx": 4}, None, 8192),
        ({"max_position_embeddings": None, "n_positions": 1024}, None, 1024),
        ({}, 2048, 2048),
        ({}, int(1e30), DEFAULT_CONTEXT_LENGTH),
        ({}, None, DEFAULT_CONTEXT_LENGTH),
    ],
)
def test_context_length_falls_back_in_order(config, model_max_length, expected):
    assert loaded_with(config, model_max_length).context_length == expected


@pytest.mark.parametrize(
    ("config", "model_max_length", "expected", "warning"),
    [
        (
            {"max_position_embeddings": 0},
            None,
            DEFAULT_CONTEXT_LENGTH,
            "config.json: no context length (its max_position_embeddings 0 states none): "
            "served with 4096 tokens, the default",
        ),
        (
            {"max_position_embeddings": 0},
            2048,
            2048,
            "config.json: max_position_embeddings 0 is no context length: served with 2048 "
            "tokens, from the tokenizer's model_max_length",
        ),
        (
            {"max_position_embeddings": "8192", "n_positions": 1024},
            None,
            1024,
            "config.json: max_position_embeddings '8192' is no context length: served with 1024 "
            "tokens, from n_positions",
        ),
        (
            {"max_position_embeddings": 2**40},
            None,
            MAX_CONTEXT_LENGTH,
            "config.json: max_position_embeddings is 1099511627776, past any model's context: "
            "served with 16777216 tokens",
        ),
        (
            {},
            None,
            DEFAULT_CONTEXT_LENGTH,
            "config.json: no context length (it states none): served with 4096 tokens, the default",
        ),
    ],
    ids=["zero", "zero-then-tokenizer", "text-then-another-key", "2^40", "none"],
)
def test_a_context_length_that_is_none_or_past_any_model_s_is_warned_of(
    caplog, config, model_max_length, expected, warning
):
    """The length served is said once, at start, with the key that gave no length."""
    loaded = loaded_with(config, model_max_length)
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        assert loaded.context_length == expected
        assert loaded.context_length == expected
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_a_stated_context_length_is_served_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        assert loaded_with({"max_position_embeddings": 8192}).context_length == 8192
    assert caplog.records == []


@pytest.mark.parametrize(
    ("written", "defaults"),
    [
        (None, {}),
        ("{not json", {}),
        (
            {"temperature": 0.6, "top_p": 0.9, "top_k": 50},
            {"temperature": 0.6, "top_p": 0.9, "top_k": 50},
        ),
        ({"temperature": "hot", "top_k": 20, "eos_token_id": 2}, {"top_k": 20}),
    ],
)
def test_generation_defaults_come_from_generation_config(tmp_path: Path, written, defaults):
    if written is not None:
        text = written if isinstance(written, str) else json.dumps(written)
        (tmp_path / "generation_config.json").write_text(text)
    assert generation_defaults(tmp_path) == defaults


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        (
            "{% for m in messages %}",
            "Unexpected end of template. Jinja was looking for the following tags: 'endfor' or "
            "'else'. The innermost block that needs to be closed is 'for'., line 1",
        ),
        ("{{ messages | nosuchfilter }}", "No filter named 'nosuchfilter'., line 1"),
    ],
    ids=["unclosed", "unknown-filter"],
)
def test_a_chat_template_that_does_not_compile_is_warned_of_at_load(
    tmp_path, caplog, template, problem
):
    """At start, not at the first chat; the model loads and completes all the same."""
    path = write_tiny_llama(tmp_path / "m", chat_template=template)
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        loaded = load_model_dir(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: the model's own chat template is not valid Jinja ({problem}): chats are "
        "refused with a 400 unless --chat-template gives another; completions are served"
    ]
    assert loaded.model(mx.array([[1, 2, 3]])).shape == (1, 3, VOCAB_SIZE)


def test_a_chat_template_that_compiles_loads_without_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        load_model_dir(write_tiny_llama(tmp_path / "m"))
    assert caplog.records == []
