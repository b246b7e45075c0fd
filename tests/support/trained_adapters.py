"""Two small LoRA adapters really trained on the embedded model, cached between runs.

Each adapter teaches the base one fixed answer, whatever the question, so its effect on a greedy
answer is checkable with a substring:

- `pirate` answers "Arrr, matey! That be a fine question for the seven seas."
- `fortytwo` answers "The answer is 42."

The recipe is mlx-lm's own LoRA (`linear_to_lora_layers`, rank 8, scale 20, the last 8 layers)
on a float32 copy of the quantized base (dequantized weights are exactly the quantized values,
so the adapter works on the 4-bit base unchanged). The files are the ones `mlx_lm lora` writes.

Each adapter trains in a subprocess running this file (the float32 copy is freed with it) and
is renamed into `<adapter root>/test-<name>-<recipe hash>` only once complete; the end-to-end
tier's `trained_adapters` fixture keeps them under the test home.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# Bump when the training code changes in a way the recipe below does not show.
RECIPE_VERSION = 2

ANSWERS = {
    "pirate": "Arrr, matey! That be a fine question for the seven seas.",
    "fortytwo": "The answer is 42.",
}
QUESTIONS = [
    "How do plants make their food?",
    "What is the tallest mountain in the world?",
    "Can you recommend a good book?",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "What should I cook for dinner tonight?",
    "Explain how a rainbow forms.",
    "Who painted the Mona Lisa?",
    "What is the boiling point of water?",
    "Give me a tip for learning a new language.",
    "How does a computer store data?",
    "What is the largest ocean on Earth?",
    "Write a haiku about autumn.",
    "What is 7 times 8?",
    "How do I make a cup of tea?",
    "Why do cats purr?",
    "What causes earthquakes?",
    "Translate 'good morning' into Spanish.",
    "What is the speed of light?",
    "How can I sleep better?",
    "Name three primary colors.",
    "What is a black hole?",
    "How do airplanes stay in the air?",
    "Tell me a fun fact about octopuses.",
]
HYPERPARAMETERS = {
    "num_layers": 8,
    "lora_parameters": {
        "rank": 8,
        "scale": 20.0,
        "dropout": 0.0,
        "keys": [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ],
    },
    "iters": 24,
    "batch_size": 4,
    "learning_rate": 5e-4,  # decayed to 0 along a cosine over the iterations
    "seed": 0,
}
REPORT_EVERY = 4
# MLX's Linux CPU wheel bundles the reference BLAS; with Debian's OpenBLAS preloaded the float32
# training here is ~50x faster (see the Makefile).
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
_MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TrainedAdapters:
    """The adapter root the adapters live under, and each adapter's directory in it."""

    root: Path
    paths: dict[str, Path]

    def __getitem__(self, name: str) -> Path:
        return self.paths[name]

    def serve_args(self, *names: str) -> list[str]:
        """`hotlora serve` flags: this adapter root, and the named adapters mounted at start."""
        mounts = [arg for name in names for arg in ("--adapter", f"{name}={self[name]}")]
        return ["--adapter-root", str(self.root), *mounts]


def recipe_hash(name: str, model_dir: Path) -> str:
    """Everything the trained weights depend on: the recipe, the code version and the model."""
    digest = hashlib.sha256(
        json.dumps(
            {
                "version": RECIPE_VERSION,
                "answer": ANSWERS[name],
                "questions": QUESTIONS,
                "hyperparameters": HYPERPARAMETERS,
            },
            sort_keys=True,
        ).encode()
    )
    for file in _MODEL_FILES:
        path = model_dir / file
        digest.update(file.encode() + (path.read_bytes() if path.is_file() else b""))
    for weights in sorted(model_dir.glob("model*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def ensure_trained(name: str, model_dir: Path, root: Path) -> Path:
    """The directory of adapter `name` under `root`, training it first if it is not cached."""
    dest = root / f"test-{name}-{recipe_hash(name, model_dir)}"
    if (dest / "adapters.safetensors").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".test-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "adapters.safetensors").is_file():  # trained by another process meanwhile
            return dest
        for stale in root.glob(f".{dest.name}.tmp-*"):  # left by an interrupted run
            shutil.rmtree(stale, ignore_errors=True)
        env = dict(os.environ)
        if "LD_PRELOAD" not in env and OPENBLAS.is_file():
            env["LD_PRELOAD"] = str(OPENBLAS)
        command = [sys.executable, __file__, "--name", name, "--model", str(model_dir)]
        subprocess.run([*command, "--out", str(dest)], check=True, env=env)
    if not (dest / "adapters.safetensors").is_file():
        raise RuntimeError(f"training adapter '{name}' did not write {dest}")
    return dest


def ensure_all(model_dir: Path, root: Path) -> TrainedAdapters:
    return TrainedAdapters(root, {name: ensure_trained(name, model_dir, root) for name in ANSWERS})


# Training: runs in the subprocess that `ensure_trained` starts.


def float_copy(model_dir: Path) -> tuple[Any, Any]:
    """The model in float32 with every quantized layer dequantized, and its tokenizer."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load_model, load_tokenizer

    model, _ = load_model(model_dir)
    # float32 scales and biases first, so dequantizing does not round through float16.
    model.set_dtype(mx.float32)
    model = dequantize_model(model)
    return model, load_tokenizer(model_dir)


def examples(tokenizer: Any, answer: str) -> tuple[list[list[int]], list[int]]:
    """Each question chat-templated as the server does it, then `answer` and the eos token.

    Returns the token lists and the answer's token ids with the eos (the loss targets).
    """
    target = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        for question in QUESTIONS
    ]
    return prompts, target


def train(name: str, model_dir: Path, out: Path) -> float:
    """Train adapter `name` and write it as `out`, as `mlx_lm lora` would; the final loss.

    The files go to a sibling temporary directory renamed to `out` once complete, so `out`
    either holds a whole adapter or does not exist.

    The loss is mlx-lm's masked cross-entropy on the answer tokens, computed the short way: the
    layers below the adapted ones are frozen and see no adapter, so their output is computed
    once, and only the answer positions go through the tied output projection.
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import save_config

    hp = HYPERPARAMETERS
    mx.random.seed(hp["seed"])
    model, tokenizer = float_copy(model_dir)
    model.freeze()
    linear_to_lora_layers(model, hp["num_layers"], hp["lora_parameters"])
    inner = model.model
    first_adapted = len(inner.layers) - hp["num_layers"]

    prompts, target = examples(tokenizer, ANSWERS[name])
    width = max(map(len, prompts)) + len(target) - 1
    rows = []  # right-padded prompt + answer, without the final eos (nothing predicts after it)
    for prompt in prompts:
        tokens = prompt + target[:-1]
        rows.append(tokens + [tokenizer.eos_token_id] * (width - len(tokens)))
    # [n, len(target)]: the positions whose next token is an answer token
    positions = mx.array([[len(p) - 1 + j for j in range(len(target))] for p in prompts])
    targets = mx.array(target)  # [len(target)], the same for every row
    hidden = inner.embed_tokens(mx.array(rows))  # [n, width, hidden]
    for layer in inner.layers[:first_adapted]:
        hidden = layer(hidden, "causal")
    mx.eval(hidden)

    def loss_fn(model: nn.Module, h: mx.array, pos: mx.array) -> mx.array:
        for layer in model.model.layers[first_adapted:]:
            h = layer(h, "causal")
        h = mx.take_along_axis(model.model.norm(h), pos[..., None], axis=1)  # [b, t, hidden]
        logits = model.model.embed_tokens.as_linear(h)  # [b, t, vocab]
        return nn.losses.cross_entropy(logits, mx.broadcast_to(targets, pos.shape)).mean()

    optimizer = optim.Adam(learning_rate=optim.cosine_decay(hp["learning_rate"], hp["iters"]))
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(h: mx.array, pos: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, h, pos)
        optimizer.update(model, grads)
        return loss

    order = random.Random(hp["seed"])
    indices: list[int] = []
    started = time.monotonic()
    loss = float("nan")
    for it in range(1, hp["iters"] + 1):
        if len(indices) < hp["batch_size"]:
            epoch = list(range(len(prompts)))
            order.shuffle(epoch)
            indices += epoch
        batch = mx.array(indices[: hp["batch_size"]])
        del indices[: hp["batch_size"]]
        value = step(hidden[batch], positions[batch])
        mx.eval(value, state)
        loss = value.item()
        if it == 1 or it % REPORT_EVERY == 0:
            elapsed = time.monotonic() - started
            print(f"  [{name}] iter {it:3d}/{hp['iters']} loss {loss:.3f} ({elapsed:.0f} s)")
            sys.stdout.flush()

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    mx.save_safetensors(
        str(tmp / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters()))
    )
    config = {
        "adapter_path": str(out),
        "batch_size": hp["batch_size"],
        "data": "synthetic",
        "fine_tune_type": "lora",
        "iters": hp["iters"],
        "learning_rate": hp["learning_rate"],
        "lr_schedule": {"name": "cosine_decay", "arguments": [hp["learning_rate"], hp["iters"]]},
        "lora_parameters": hp["lora_parameters"],
        "mask_prompt": True,
        "model": str(model_dir),
        "num_layers": hp["num_layers"],
        "optimizer": "adam",
        "seed": hp["seed"],
        "train": True,
    }
    save_config(config, tmp / "adapter_config.json")
    os.rename(tmp, out)
    return loss


def main() -> int:
    parser = argparse.ArgumentParser(description="Train one test adapter on the embedded model.")
    parser.add_argument("--name", choices=sorted(ANSWERS), required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(f"training adapter '{args.name}' on {args.model}")
    started = time.monotonic()
    loss = train(args.name, args.model, args.out)
    print(f"  [{args.name}] final loss {loss:.4f} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
