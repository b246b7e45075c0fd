"""lm-evaluation-harness end to end: `lm_eval --model local-completions` against a real server on
the embedded model, on the base and on the trained `pirate` adapter.

Three tiny local tasks from one JSON dataset: multiple choice (loglikelihood requests, `echo`
with `max_tokens` 1), `loglikelihood_rolling` (perplexity) and `generate_until`. Each model is
evaluated with `num_concurrent` 8 (its requests batched together) and again with 1: each
model's scores are the same numbers whatever the concurrency, and the adapter's differ from the
base's. `lm_eval[api]` and `transformers` come with the test extra (no PyTorch needed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.e2e

DOCS = [
    {
        "question": "What is the capital of France?",
        "choices": ["Paris", "London", "Berlin", "Madrid"],
        "answer": 0,
        "text": "Paris is the capital and largest city of France.",
    },
    {
        "question": "How many legs does a spider have?",
        "choices": ["Six", "Eight", "Ten", "Four"],
        "answer": 1,
        "text": "Spiders have eight legs and most of them have eight eyes.",
    },
    {
        "question": "What color is the sky on a clear day?",
        "choices": ["Green", "Red", "Blue", "Yellow"],
        "answer": 2,
        "text": "On a clear day the sky looks blue because the air scatters blue light.",
    },
    {
        "question": "What is 7 times 8?",
        "choices": ["54", "64", "42", "56"],
        "answer": 3,
        "text": "Seven times eight is fifty-six.",
    },
]
COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
TASKS = {
    "tiny_mc": """output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""",
    "tiny_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}
RUN_TIMEOUT_S = 600


def write_tasks(folder: Path) -> Path:
    """The dataset and one YAML per task in `folder`; returns it (lm_eval's --include_path)."""
    folder.mkdir(parents=True)
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, body in TASKS.items():
        text = f"task: {name}\n" + COMMON.format(data=data) + body.format()
        (folder / f"{name}.yaml").write_text(text)
    return folder


# lm_eval's own command line, run once per argument list in one process: importing lm_eval
# (datasets, transformers, ...) takes most of a run's time on a small machine.
RUN_EACH = """
import json, sys
from lm_eval.__main__ import cli_evaluate
for argv in json.loads(sys.argv[1]):
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
"""


def lm_eval_args(
    server: ServerProcess, model: str, concurrent: int, tasks: Path, out: Path, model_dir: Path
) -> list[str]:
    """`lm_eval`'s arguments for `model` on the server, its output under `out`."""
    model_args = ",".join(
        [
            f"model={model}",
            f"base_url={server.url}/v1/completions",
            f"tokenizer={model_dir}",
            "tokenizer_backend=huggingface",
            f"num_concurrent={concurrent}",
            "max_retries=1",
        ]
    )
    return [
        *("--model", "local-completions", "--model_args", model_args),
        *("--tasks", ",".join(TASKS), "--include_path", str(tasks)),
        *("--output_path", str(out / "results"), "--log_samples"),
    ]


def run_lm_eval(runs: list[list[str]], home: Path) -> subprocess.CompletedProcess[str]:
    """lm_eval's command line once per argument list, offline, its caches under `home`."""
    env = {
        **os.environ,
        "HF_HOME": str(home / "hf"),
        "HF_DATASETS_CACHE": str(home / "hf" / "datasets"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HOME": str(home),
    }
    env.pop("LD_PRELOAD", None)  # lm_eval needs none of the server's BLAS
    command = [sys.executable, "-c", RUN_EACH, json.dumps(runs)]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )


def results(out: Path) -> dict[str, dict[str, Any]]:
    """Each task's metrics from the run's results file (aliases and sample counts left out)."""
    [path] = list((out / "results").rglob("results_*.json"))
    found = json.loads(path.read_text())["results"]
    return {
        task: {k: v for k, v in metrics.items() if k != "alias"} for task, metrics in found.items()
    }


def rolling_loglikelihoods(out: Path) -> dict[str, float]:
    """tiny_ppl's loglikelihood of each document's text, as lm_eval logged its samples."""
    [path] = list((out / "results").rglob("samples_tiny_ppl_*.jsonl"))
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    return {sample["doc"]["text"]: float(sample["filtered_resps"][0]) for sample in samples}


def echoed(server: ServerProcess, model: str, tokens: list[int], max_tokens: int) -> Any:
    """The choice of `tokens` echoed with their scores and `max_tokens` more."""
    body = {"model": model, "prompt": tokens, "echo": True, "logprobs": 1, "temperature": 0}
    body["max_tokens"] = max_tokens
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_lm_eval_scores_base_and_adapter_the_same_at_any_concurrency(
    pirate_server: ServerProcess, embedded_model_dir: Path, tmp_path: Path
):
    if importlib.util.find_spec("lm_eval") is None:
        pytest.fail("lm_eval is not installed: `make setup` installs the test extra (lm_eval[api])")
    tasks = write_tasks(tmp_path / "tasks")
    runs = {
        (model, concurrent): tmp_path / f"{model}-{concurrent}"
        for model in (pirate_server.model_id, "pirate")
        for concurrent in (8, 1)
    }
    argvs = [
        lm_eval_args(pirate_server, *run, tasks, out, embedded_model_dir)
        for run, out in runs.items()
    ]
    done = run_lm_eval(argvs, tmp_path / "home")
    assert done.returncode == 0, f"lm_eval exited {done.returncode}:\n{done.stdout[-4000:]}"
    scores = {run: results(out) for run, out in runs.items()}
    base, adapter = scores[(pirate_server.model_id, 8)], scores[("pirate", 8)]
    assert set(base) == set(TASKS)
    for task in TASKS:
        assert base[task], task
    assert base["tiny_ppl"] != adapter["tiny_ppl"]
    assert base["tiny_mc"] != adapter["tiny_mc"] or base["tiny_gen"] != adapter["tiny_gen"]
    assert scores[(pirate_server.model_id, 1)] == base
    assert scores[("pirate", 1)] == adapter
    # Each text's loglikelihood is every one of its tokens' scores after lm_eval's prefix
    # token, as the server scores the text alone: none left out, whichever token the model
    # would write after it (an end of text included).
    from transformers import AutoTokenizer  # lm_eval's own tokenizer, with the test extra

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prefix = tokenizer.bos_token_id
    if prefix is None:  # lm_eval's prefix token: the BOS, else the EOS
        prefix = tokenizer.eos_token_id
    endings = set()
    for model in (pirate_server.model_id, "pirate"):
        logged = rolling_loglikelihoods(runs[(model, 8)])
        assert set(logged) == {doc["text"] for doc in DOCS}
        for text, value in logged.items():
            tokens = [prefix, *tokenizer.encode(text, add_special_tokens=False)]
            alone = echoed(pirate_server, model, tokens, 0)["logprobs"]["token_logprobs"][1:]
            assert value == pytest.approx(sum(alone), abs=1e-4)
            endings.add(echoed(pirate_server, model, tokens, 1)["finish_reason"])
    assert endings == {"stop", "length"}  # some text the model would end there: the case held
    print(json.dumps({"base": base, "pirate": adapter}, indent=1))
