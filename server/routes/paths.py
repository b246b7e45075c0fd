"""The API's paths, written once: the routers serve them and the Ray ingress routes by them."""

from __future__ import annotations

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
VERSION = "/version"
MODELS = "/v1/models"
ADAPTERS = "/v1/adapters"
ADAPTER_ROOT = "/v1/adapter_root"  # what the adapter root holds, resident or not
LOAD_LORA_ADAPTER = "/v1/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/v1/unload_lora_adapter"
USAGE = "/v1/usage"  # each tenant's usage, for an admin

# The routes that run the model: what a request's `model` and `adapter` fields select runs there.
INFERENCE = frozenset({CHAT_COMPLETIONS, COMPLETIONS, RESPONSES, EMBEDDINGS})
# The routes whose last segment is one adapter's or model's id.
BY_ID = (f"{ADAPTERS}/", f"{MODELS}/")
