"""mlx-lm's `stream_generate` in-process: the ceiling for any server on MLX.

Run as its own process (`python -m tests.bench.direct`) once the servers are stopped, so it never
competes with them for the cores. Reads {"model", "max_tokens", "warmup", "questions"} as JSON
on stdin and writes one JSON list of samples on stdout.
"""

from __future__ import annotations

import json
import sys
import time

from tests.bench.servers import Sample, decode_rate

SYSTEM = "stream_generate"


def run(model_dir: str, max_tokens: int, warmup: str, questions: list[str]) -> list[Sample]:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(model_dir)[:2]
    sampler = make_sampler(temp=0.0)

    def one(question: str, round_: int) -> Sample:
        t0 = time.perf_counter()
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        t_first = t_last = 0.0
        text, tokens, finish = [], 0, ""
        for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler):
            finish = r.finish_reason or finish
            if r.finish_reason == "stop":  # the eos token: not shown, not counted
                break
            t_last = time.perf_counter()
            t_first = t_first or t_last
            tokens += 1
            text.append(r.text)
        return Sample(
            system=SYSTEM,
            round=round_,
            ttft_s=t_first - t0,
            decode_tok_s=decode_rate(tokens, t_first, t_last),
            tokens=tokens,
            prompt_tokens=len(prompt),
            finish_reason=finish,
            text="".join(text),
            chunks=tokens,
            cached_tokens=0,
        )

    one(warmup, -1)
    return [one(q, i) for i, q in enumerate(questions)]


def main() -> int:
    job = json.load(sys.stdin)
    samples = run(job["model"], job["max_tokens"], job["warmup"], job["questions"])
    json.dump([s.as_json() for s in samples], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
