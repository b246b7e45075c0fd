"""Config dialects: one test per rule, and the table that picks exactly one rule."""

import copy
import dataclasses

import pytest
from mlx_lm.models import llama, qwen3, qwen3_5

from hotlora.models.dialects import (
    DEFAULT_RULE,
    RULES,
    DialectRule,
    UnsupportedConfig,
    read_config,
    rule_for,
)

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128,
    "rope_theta": 500000.0,
}

QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
    "head_dim": 16,
    "tie_word_embeddings": True,
}

QWEN3_5 = {
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [11, 11, 10],
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
        },
    },
}

DIFFUSION_GEMMA = {
    "model_type": "diffusion_gemma",
    "text_config": {"model_type": "diffusion_gemma_text", "hidden_size": 64, "head_dim": 32},
}


def with_text(config: dict, **fields) -> dict:
    config = copy.deepcopy(config)
    config["text_config"].update(fields)
    return config


# --- llama: theta layout, every layer full attention by default ---


def test_llama_fills_full_attention_layer_types_when_missing():
    config = read_config(LLAMA)
    assert config["layer_types"] == ["full_attention"] * 3


def test_llama_keeps_the_layer_types_it_is_given():
    given = ["sliding_attention", "full_attention", "sliding_attention"]
    config = read_config({**LLAMA, "layer_types": given})
    assert config["layer_types"] == given
    assert set(config["rope_parameters"]) == {"sliding_attention", "full_attention"}


def test_theta_falls_back_to_flat_rope_theta_when_the_map_is_missing():
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    config = read_config({**LLAMA, "rope_scaling": scaling})
    entry = {**scaling, "rope_theta": 500000.0}
    assert config["rope_parameters"] == {"full_attention": entry}
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == scaling


def test_theta_spells_out_the_old_type_key():
    config = read_config({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}})
    entry = config["rope_parameters"]["full_attention"]
    assert entry == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}


def test_theta_reads_a_flat_rope_parameters_dict_into_the_flat_keys_llama_reads():
    raw = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 250000.0, "factor": 8.0}
    config = read_config(raw)
    assert config["rope_parameters"] == {"full_attention": raw["rope_parameters"]}
    args = llama.ModelArgs.from_dict(config)
    assert args.rope_theta == 250000.0
    assert args.rope_scaling == {"rope_type": "llama3", "factor": 8.0}


def test_theta_keeps_a_per_attention_type_map_and_takes_theta_from_full_attention():
    rope_map = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    raw = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    config = read_config({**raw, "rope_parameters": rope_map})
    assert config["rope_parameters"] == rope_map
    assert config["rope_theta"] == 1e6
    assert "rope_scaling" not in config


def test_theta_without_any_rope_field_leaves_the_model_default():
    raw = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    config = read_config(raw)
    assert "rope_parameters" not in config and "rope_theta" not in config
    assert llama.ModelArgs.from_dict(config).rope_theta == 10000


# --- qwen3: theta layout ---


def test_qwen3_theta_normalises_and_still_builds_the_mlx_lm_model():
    raw = {**QWEN3, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    config = read_config(raw)
    assert config["rope_parameters"] == {"full_attention": raw["rope_parameters"]}
    assert config["rope_theta"] == 1_000_000.0
    assert "layer_types" not in config  # qwen3 has no full-attention default
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    assert model.model.layers[0].self_attn.rope.base == 1_000_000.0


def test_qwen3_theta_falls_back_to_flat_rope_theta():
    config = read_config({**QWEN3, "rope_theta": 5000.0})
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 5000.0}
    }
    assert qwen3.ModelArgs.from_dict(config).rope_theta == 5000.0


def test_qwen3_scaled_entry_reaches_the_flat_rope_scaling():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    config = read_config({**QWEN3, "rope_parameters": {**yarn, "rope_theta": 1e6}})
    assert config["rope_scaling"] == yarn
    assert qwen3.ModelArgs.from_dict(config).rope_scaling == yarn


# --- qwen3_5*: flat layout and the output-gate check ---


def test_qwen3_5_keeps_one_flat_rope_dict_inside_text_config():
    config = read_config(QWEN3_5)
    text = config["text_config"]
    assert text["rope_parameters"] == QWEN3_5["text_config"]["rope_parameters"]
    assert text["rope_theta"] == 10_000_000
    assert "layer_types" not in text
    assert qwen3_5.TextModelArgs.from_dict(text).rope_theta == 10_000_000


def test_qwen3_5_collapses_a_rope_map_to_its_full_attention_entry():
    entry = {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25}
    config = read_config(with_text(QWEN3_5, rope_parameters={"full_attention": entry}))
    assert config["text_config"]["rope_parameters"] == entry


def test_qwen3_5_builds_the_flat_dict_from_flat_rope_theta():
    text = {k: v for k, v in QWEN3_5["text_config"].items() if k != "rope_parameters"}
    config = read_config({**QWEN3_5, "text_config": {**text, "rope_theta": 1e6}})
    assert config["text_config"]["rope_parameters"] == {"rope_theta": 1e6}


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_accepts_the_swish_output_gate(model_type):
    raw = with_text({**QWEN3_5, "model_type": model_type}, output_gate_type="swish")
    assert read_config(raw)["text_config"]["output_gate_type"] == "swish"


@pytest.mark.parametrize("where", ["text_config", "top level"])
def test_qwen3_5_refuses_an_unverified_output_gate(where):
    raw = copy.deepcopy(QWEN3_5)
    (raw["text_config"] if where == "text_config" else raw)["output_gate_type"] = "sigmoid"
    with pytest.raises(UnsupportedConfig) as refused:
        read_config(raw)
    message = str(refused.value)
    assert "qwen3_5" in message
    assert "output_gate_type" in message and "'sigmoid'" in message and "'swish'" in message
    assert refused.value.field == "output_gate_type"
    assert refused.value.allowed == ("swish",)


# --- diffusion_gemma: its architecture defaults, map layout ---


def test_diffusion_gemma_defaults_fill_text_config_and_present_fields_win():
    config = read_config(DIFFUSION_GEMMA)
    text = config["text_config"]
    assert text["hidden_activation"] == "gelu_pytorch_tanh"
    assert text["rms_norm_eps"] == 1e-6
    assert text["final_logit_softcapping"] == 30.0
    assert text["tie_word_embeddings"] is True
    assert text["attention_bias"] is False
    assert text["head_dim"] == 32  # given, so the default 256 does not apply
    assert "hidden_activation" not in config  # defaults go where the text fields live
    assert set(text["rope_parameters"]) == {"sliding_attention", "full_attention"}
    assert text["rope_theta"] == 1_000_000.0
    assert text["rope_scaling"]["rope_type"] == "proportional"
    assert "layer_types" not in text  # no full-attention default for this family


def test_a_null_field_takes_the_default():
    config = read_config(with_text(DIFFUSION_GEMMA, rms_norm_eps=None))
    assert config["text_config"]["rms_norm_eps"] == 1e-6


def test_defaults_apply_at_top_level_without_a_text_config():
    config = read_config({"model_type": "diffusion_gemma", "rms_norm_eps": 1e-5})
    assert config["rms_norm_eps"] == 1e-5
    assert config["hidden_activation"] == "gelu_pytorch_tanh"


def test_map_layout_refuses_a_config_without_rope_parameters():
    rules = (DialectRule(name="gemma_like", rope_layout="map"),)
    with pytest.raises(UnsupportedConfig, match="rope_parameters"):
        read_config({"model_type": "gemma_like", "rope_theta": 1e4}, rules)


# --- the plain default ---


@pytest.mark.parametrize("model_type", ["made_up_arch", "qwen3_moe", "mistral", "gemma3_text"])
def test_other_types_are_read_by_the_plain_default_unchanged(model_type):
    raw = {"model_type": model_type, "rope_theta": 1e4, "num_hidden_layers": 2}
    assert rule_for(model_type) is DEFAULT_RULE
    assert read_config(raw) == raw


# --- the table ---


@pytest.mark.parametrize(
    ("model_type", "rule_name"),
    [
        ("llama", "llama"),
        ("qwen3", "qwen3"),
        ("qwen3_5", "qwen3_5*"),
        ("qwen3_5_moe", "qwen3_5*"),
        ("qwen3_5_text", "qwen3_5*"),
        ("diffusion_gemma", "diffusion_gemma"),
        ("llama4", "default"),
        ("qwen3_next", "default"),
        ("", "default"),
    ],
)
def test_exactly_one_rule_applies(model_type, rule_name):
    matching = [rule for rule in RULES if rule.specificity(model_type) is not None]
    assert len(matching) <= 1
    assert rule_for(model_type).name == rule_name


def test_the_most_specific_rule_wins():
    rules = (DialectRule("qwen3*"), DialectRule("qwen3"), DialectRule("qwen3_5*"))
    assert rule_for("qwen3", rules).name == "qwen3"
    assert rule_for("qwen3_5_moe", rules).name == "qwen3_5*"
    assert rule_for("qwen3_moe", rules).name == "qwen3*"


def test_an_ambiguous_table_is_an_error():
    rules = (DialectRule("qwen3_*"), DialectRule("qwen3*5"))
    with pytest.raises(ValueError, match="ambiguous"):
        rule_for("qwen3_5", rules)


def test_rules_are_frozen_and_their_defaults_read_only():
    rule = rule_for("diffusion_gemma")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        rule.text_defaults["head_dim"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    "raw", [LLAMA, QWEN3, QWEN3_5, DIFFUSION_GEMMA], ids=lambda r: r["model_type"]
)
def test_read_config_keeps_every_raw_key_and_leaves_raw_alone(raw):
    before = copy.deepcopy(raw)
    config = read_config(raw)
    assert raw == before
    assert set(raw) <= set(config)
    if "text_config" in raw:
        assert set(raw["text_config"]) <= set(config["text_config"])
