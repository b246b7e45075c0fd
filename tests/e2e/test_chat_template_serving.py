"""`hotlora serve` on a GGUF without a chat template, as a user runs it: the family's template and
the end-of-generation set are in its log, the answer stops at the end of the turn; a bad
`--chat-template` stops it with one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.support.server_process import ServerProcess, hotlora_spec
from tests.support.turn_models import CONVERSATION, TURN_FAMILIES, write_turn_gguf

pytestmark = pytest.mark.e2e


def test_a_bad_chat_template_stops_the_start_with_one_line(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "hotlora.server.cli", "serve", "--chat-template", "chatlm"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "hotlora serve: --chat-template: chatlm is neither a built-in template (chatml, gemma, "
        "llama3, mistral, phi3, smollm2) nor a file\n"
    )


def test_a_gemma_gguf_without_a_template_chats_and_stops_at_its_turns_end(tmp_path: Path):
    turn = TURN_FAMILIES["gemma"]
    gguf = write_turn_gguf(tmp_path / "tiny-gemma.gguf", turn)
    spec = hotlora_spec("--model", str(gguf), "--home", str(tmp_path), "--no-warmup")
    with ServerProcess(spec, log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        (card,) = client.models.list().data
        assert card.model_extra is not None
        ends = {entry["token"]: entry["id"] for entry in card.model_extra["end_of_generation"]}
        answer = client.chat.completions.create(
            model=server.model_id,
            messages=CONVERSATION,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            logit_bias={str(ends["<end_of_turn>"]): 100},
            extra_body={"min_tokens": 2},
        )
        log = server.log(lines=400)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    assert (
        "chats are rendered with the built-in 'gemma' template of its family (gemma3_text)" in log
    )
    end = ends["<end_of_turn>"]
    assert "end of generation: '</s>' (2: eos, generation_config, end-of-turn name), " in log
    assert f"'<end_of_turn>' ({end}: end-of-turn name, chat template)" in log
