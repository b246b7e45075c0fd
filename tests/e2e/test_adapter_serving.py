"""End to end with really trained adapters: a real uvicorn process on the embedded model.

`pirate` is mounted at start-up (`--adapter`), `fortytwo` through the admin API. Every answer is
greedy on the same question, so the server's prompt cache keeps each request short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest

from tests.support.server_process import ServerProcess, hotlora_spec
from tests.support.trained_adapters import ANSWERS, HYPERPARAMETERS, TrainedAdapters

pytestmark = pytest.mark.e2e

# With "Answer in one sentence." the base model's first token is no near-tie ("The" 1.5 above
# "Paris" on either CPU path; the bare question leaves "The" and "L" 0.08 apart of 25).
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
MAX_TOKENS = 20  # every single-adapter answer (16 tokens at most) ends before this
PIRATE, FORTYTWO = ANSWERS["pirate"], ANSWERS["fortytwo"]


@pytest.fixture(scope="module")
def model_dir(embedded_model_dir: Path) -> Path:
    return embedded_model_dir


@dataclass
class Api:
    """The served model through the openai client, admin calls through httpx."""

    server: ServerProcess
    base_id: str
    client: openai.OpenAI = field(init=False)
    http: httpx.Client = field(init=False)
    base_first: str = ""  # the base answer before any adapter request
    _alone: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        url = self.server.url
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180
        )
        self.http = httpx.Client(base_url=url, timeout=180)

    def chat(self, adapter: Any = None, *, model: str | None = None, **fields: Any) -> Any:
        return self.client.chat.completions.create(
            model=model or self.base_id,
            messages=MESSAGES,
            max_tokens=fields.pop("max_tokens", MAX_TOKENS),
            temperature=0,
            extra_body={} if adapter is None else {"adapter": adapter},
            **fields,
        )

    def text(self, adapter: Any = None, **fields: Any) -> str:
        return self.chat(adapter, **fields).choices[0].message.content

    def alone(self, adapter: Any) -> str:
        """The answer under `adapter` when nothing else runs (asked once, then remembered)."""
        key = json.dumps(adapter)
        if key not in self._alone:
            self._alone[key] = self.text(adapter)
        return self._alone[key]

    def mount(self, adapter_id: str, path: Path | str, **extra: Any) -> httpx.Response:
        return self.http.post("/v1/adapters", json={"id": adapter_id, "path": str(path), **extra})

    def adapters(self) -> dict[str, dict[str, Any]]:
        return {card["id"]: card for card in self.http.get("/v1/adapters").json()["data"]}

    def rss_kib(self) -> int:
        assert self.server.proc is not None
        status = Path(f"/proc/{self.server.proc.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1])


@pytest.fixture(scope="module")
def api(model_dir: Path, trained_adapters: TrainedAdapters) -> Iterator[Api]:
    spec = hotlora_spec("--model", str(model_dir), *trained_adapters.serve_args("pirate"))
    with ServerProcess(spec) as server:
        api = Api(server, model_dir.name)
        api.base_first = api.text()
        response = api.mount("fortytwo", trained_adapters["fortytwo"].name)  # relative to root
        assert response.status_code == 201, response.text
        yield api
        api.http.close()


def in_stream_order(stream: Any) -> Iterator[str]:
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            yield chunk.choices[0].delta.content


# Numbers, in-process: the server's adapter path against mlx-lm's own loader.


@dataclass
class InProcess:
    """The server's model and adapter manager, built as the runtime builds them, in this process."""

    model: Any
    manager: Any
    tokens: mx.array  # [1, prompt length]: the chat prompt every HTTP test asks
    _logits: dict[str, mx.array] = field(default_factory=dict)

    def logits(self, spec: str) -> mx.array:
        """The logits with the adapter set `spec` active, as the engine computes them."""
        from hotlora.adapters import activate, parse_adapter_spec

        if spec not in self._logits:
            with activate(self.manager.resolve(parse_adapter_spec(spec))):
                self._logits[spec] = self.model(self.tokens)
            mx.eval(self._logits[spec])
        return self._logits[spec]


@pytest.fixture(scope="module")
def in_process(model_dir: Path, trained_adapters: TrainedAdapters) -> InProcess:
    from hotlora.adapters import AdapterManager
    from hotlora.models.loader import load_model_dir

    loaded = load_model_dir(model_dir)
    manager = AdapterManager(
        loaded.model, base_id=model_dir.name, adapter_root=trained_adapters.root, max_rank=64
    )
    for name, path in trained_adapters.paths.items():
        manager.mount(name, path)
    prompt = loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return InProcess(loaded.model, manager, mx.array([prompt]))


def mlx_lm_logits(model_dir: Path, adapter: Path, tokens: mx.array) -> mx.array:
    from mlx_lm.utils import load

    model, _ = load(str(model_dir), adapter_path=str(adapter))
    return model(tokens)


def assert_close(got: mx.array, expected: mx.array) -> None:
    # Relative to the logits' own scale (~50 here); the adapters move them by ~30.
    tolerance = 1e-4 * mx.abs(expected).max().item()
    difference = mx.abs(got - expected).max().item()
    assert difference <= tolerance, f"logits differ by {difference} (tolerance {tolerance})"


@pytest.mark.parametrize("name", ["pirate", "fortytwo"])
def test_mounted_adapter_logits_equal_mlx_lm_load_adapters(
    in_process: InProcess, model_dir: Path, trained_adapters: TrainedAdapters, name: str
):
    expected = mlx_lm_logits(model_dir, trained_adapters[name], in_process.tokens)
    assert_close(in_process.logits(name), expected)
    # The adapter really moves the logits.
    assert mx.abs(expected - in_process.logits("")).max().item() > 1.0


def test_stack_logits_equal_one_concatenated_adapter(
    in_process: InProcess, model_dir: Path, trained_adapters: TrainedAdapters, tmp_path: Path
):
    """`pirate@0.5+fortytwo` against mlx-lm running a single rank-16 adapter.

    A stack adds `w_i * s_i * (x @ A_i) @ B_i` per projection. With `A = [A_p | A_f]` (columns)
    and `B = [w_p s_p B_p ; w_f s_f B_f]` (rows), `(x @ A) @ B` is exactly that sum, so one
    mlx-lm adapter of rank 16 and scale 1 computes base plus both residuals in every layer;
    only the summation order differs, hence a float tolerance rather than equality.
    """
    weights = {"pirate": 0.5, "fortytwo": 1.0}
    scale = HYPERPARAMETERS["lora_parameters"]["scale"]
    files = {n: mx.load(str(trained_adapters[n] / "adapters.safetensors")) for n in weights}
    concatenated = {}
    for key in files["pirate"]:
        if key.endswith(".lora_a"):  # [in, r] -> [in, 2r]
            concatenated[key] = mx.concatenate([files[n][key] for n in weights], axis=1)
        else:  # lora_b [r, out] -> [2r, out], each block carrying its scale and weight
            blocks = [files[n][key] * (scale * w) for n, w in weights.items()]
            concatenated[key] = mx.concatenate(blocks, axis=0)
    out = tmp_path / "stacked"
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), concatenated)
    config = json.loads((trained_adapters["pirate"] / "adapter_config.json").read_text())
    rank = 2 * config["lora_parameters"]["rank"]
    config["lora_parameters"] = {**config["lora_parameters"], "rank": rank, "scale": 1.0}
    (out / "adapter_config.json").write_text(json.dumps(config))

    expected = mlx_lm_logits(model_dir, out, in_process.tokens)
    got = in_process.logits("pirate@0.5+fortytwo")
    assert_close(got, expected)
    for single in ("pirate", "fortytwo"):
        assert mx.abs(got - in_process.logits(single)).max().item() > 1.0


@pytest.fixture(scope="module")
def packed(
    model_dir: Path, trained_adapters: TrainedAdapters, hotlora_home: Path
) -> dict[str, InProcess]:
    """The model as a CPU server serves it (packed 4-bit weights, native kernels), with the
    adapters kept in float32 (`--adapter-dtype float32`) and in float16 (the default there):
    one model, an adapter manager for each."""
    from hotlora.adapters import AdapterManager
    from hotlora.config.settings import Settings
    from hotlora.models.cpu import prepare_cpu
    from hotlora.models.loader import load_model_dir

    loaded = load_model_dir(model_dir)
    settings = Settings(home=hotlora_home)
    prepare_cpu(
        loaded.model,
        weights=settings.cpu_weights,
        float_budget=settings.cpu_float_budget_bytes,
        vector_jit=False,  # it would point this process's TMPDIR into the test home
        batch_kernels=settings.cpu_native_kernels,
        home=settings.home,
    )
    prompt = mx.array([loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)])
    kept = {}
    for name, dtype in (("float32", mx.float32), ("float16", mx.float16)):
        manager = AdapterManager(
            loaded.model,
            base_id=model_dir.name,
            adapter_root=trained_adapters.root,
            max_rank=64,
            adapter_dtype=dtype,
        )
        for adapter, path in trained_adapters.paths.items():
            manager.mount(adapter, path)
        kept[name] = InProcess(loaded.model, manager, prompt)
    return kept


@pytest.mark.parametrize("name", ["pirate", "fortytwo"])
def test_float16_adapters_stay_within_the_tolerance_of_float32_ones(
    packed: dict[str, InProcess], trained_adapters: TrainedAdapters, name: str
):
    """Rounded to float16 when mounted, an adapter holds half the memory and its logits stay
    within 1e-4 of the largest logit of the same adapter kept in float32 (the packed path's
    own agreement with mlx-lm's float32 reference is tested on its own)."""
    stored = mx.load(str(trained_adapters[name] / "adapters.safetensors")).values()
    assert packed["float16"].manager.get(name).ram_bytes * 2 == sum(a.nbytes for a in stored)
    assert packed["float32"].manager.get(name).ram_bytes == sum(a.nbytes for a in stored)
    single, half = packed["float32"].logits(name), packed["float16"].logits(name)
    assert not mx.array_equal(single, half).item()  # really rounded
    assert_close(half, single)
    assert mx.abs(single - packed["float32"].logits("")).max().item() > 1.0


@pytest.mark.parametrize("name", ["pirate", "fortytwo"])
def test_float16_adapters_on_packed_weights_agree_with_mlx_lm_within_the_tolerance(
    packed: dict[str, InProcess], model_dir: Path, trained_adapters: TrainedAdapters, name: str
):
    """What a CPU server computes by default, packed kernels and adapters rounded to float16,
    against the fidelity reference: mlx-lm's float32 run, on the base's weights dequantized
    exactly, of the adapter as stored (float32). Within the bound, and moved by the rounding
    alone by no more than that."""
    from mlx_lm.utils import load

    from tests.support.fidelity import dequantized_reference

    model, _ = load(str(model_dir), adapter_path=str(trained_adapters[name]))
    expected = dequantized_reference(model)(packed["float16"].tokens)
    assert_close(packed["float32"].logits(name), expected)
    assert_close(packed["float16"].logits(name), expected)
    assert mx.abs(expected - packed["float16"].logits("")).max().item() > 1.0


# Behaviour over HTTP.


def test_models_list_the_adapters_under_the_base(api: Api, trained_adapters: TrainedAdapters):
    cards = {card.id: card for card in api.client.models.list().data}
    assert set(cards) == {api.base_id, "pirate", "fortytwo"}
    assert cards[api.base_id].model_extra["parent"] is None
    for name in ("pirate", "fortytwo"):
        assert cards[name].model_extra["parent"] == api.base_id
        assert cards[name].model_extra["root"] == str(trained_adapters[name])
    assert api.adapters()["fortytwo"]["rank"] == HYPERPARAMETERS["lora_parameters"]["rank"]


def test_each_adapter_answers_as_trained_and_the_base_stays(api: Api):
    assert "Paris" in api.base_first
    assert api.alone("pirate") == PIRATE
    assert api.text() == api.base_first
    assert api.alone("fortytwo") == FORTYTWO
    assert api.text() == api.base_first


def test_stacks_weights_and_model_spellings(api: Api):
    pirate, fortytwo = api.alone("pirate"), api.alone("fortytwo")
    stack = api.alone("pirate+fortytwo")
    assert stack not in (pirate, fortytwo, api.base_first)
    listed = api.text([{"id": "pirate"}, {"id": "fortytwo", "scale": 1.0}])
    assert listed == stack
    assert api.text("pirate@0") == api.base_first
    assert api.text("fortytwo@0+pirate") == pirate

    spelled = api.chat(model=f"{api.base_id}:pirate+fortytwo")
    assert spelled.choices[0].message.content == stack
    assert spelled.model == f"{api.base_id}:pirate+fortytwo"
    by_id = api.chat(model="fortytwo")
    assert by_id.choices[0].message.content == fortytwo
    assert by_id.model == "fortytwo"
    assert api.chat("pirate").model == f"{api.base_id}:pirate"


def test_concurrent_requests_get_what_they_got_alone(api: Api):
    specs = [None, "pirate", "fortytwo", "pirate+fortytwo", "pirate@0.5"]
    specs += [None, "fortytwo", "pirate"]
    expected = [api.base_first if spec is None else api.alone(spec) for spec in specs]
    with ThreadPoolExecutor(len(specs)) as pool:
        got = list(pool.map(api.text, specs))
    assert got == expected


def test_unmount_while_streaming(api: Api, trained_adapters: TrainedAdapters):
    pirate = api.alone("pirate")
    stream = api.chat("pirate", max_tokens=40, stream=True)
    parts = in_stream_order(stream)
    text = next(parts)
    assert api.adapters()["pirate"]["in_use"] == 1  # the stream is still generating
    with ThreadPoolExecutor(1) as pool:
        base = pool.submit(api.text)  # queued behind the stream
        deleted = api.http.delete("/v1/adapters/pirate")
        assert deleted.json() == {"id": "pirate", "object": "adapter", "deleted": True}
        with pytest.raises(openai.NotFoundError) as refused:
            api.chat("pirate")
        assert "Mounted adapters: fortytwo." in refused.value.body["message"]
        assert refused.value.body["param"] == "adapter"
        with pytest.raises(openai.NotFoundError):
            api.chat(model="pirate")
        text += "".join(parts)
        assert base.result() == api.base_first
    assert text == pirate

    assert api.mount("pirate", trained_adapters["pirate"]).status_code == 201
    assert api.text("pirate") == pirate


def test_replace_while_streaming(api: Api, trained_adapters: TrainedAdapters):
    pirate, fortytwo = api.alone("pirate"), api.alone("fortytwo")
    revisions = {name: info["revision"] for name, info in api.adapters().items()}
    stream = api.chat("pirate", max_tokens=40, stream=True)
    parts = in_stream_order(stream)
    text = next(parts)
    with ThreadPoolExecutor(1) as pool:
        replaced = api.mount("pirate", trained_adapters["fortytwo"], replace=True)
        assert replaced.status_code == 201
        assert replaced.json()["revision"] == revisions["fortytwo"]
        after = pool.submit(api.text, "pirate")  # queued behind the stream, resolved now
        text += "".join(parts)
        assert after.result() == fortytwo
    assert text == pirate

    conflict = api.mount("pirate", trained_adapters["pirate"])
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "adapter_conflict"
    assert api.mount("pirate", trained_adapters["pirate"], replace=True).status_code == 201
    assert api.mount("pirate", trained_adapters["pirate"]).status_code == 200  # same revision
    assert api.text("pirate") == pirate


def test_mount_unmount_churn_keeps_memory_flat(api: Api, trained_adapters: TrainedAdapters):
    path = str(trained_adapters["fortytwo"])

    def cycle(i: int) -> None:
        if i % 2:  # vLLM's spelling, answered as vLLM does
            loaded = api.http.post(
                "/v1/load_lora_adapter", json={"lora_name": "churn", "lora_path": path}
            )
            unloaded = api.http.post("/v1/unload_lora_adapter", json={"lora_name": "churn"})
            assert (loaded.status_code, unloaded.status_code) == (200, 200)
        else:
            loaded = api.mount("churn", path)
            unloaded = api.http.delete("/v1/adapters/churn")
            assert (loaded.status_code, unloaded.status_code) == (201, 200)

    for i in range(20):  # warm the allocator and the HTTP paths
        cycle(i)
    before = api.rss_kib()
    for i in range(200):
        cycle(i)
    grown = api.rss_kib() - before
    # One mounted copy of the adapter is ~2.4 MiB, so a leak would show as ~480 MiB; a few MiB
    # are the allocator's (the revision hash runs on a pool thread, with an arena of its own).
    assert grown < 16 * 1024, f"RSS grew by {grown} KiB over 200 mount/unmount cycles"

    assert api.http.delete("/v1/adapters/pirate").status_code == 200
    unloaded = api.http.post("/v1/unload_lora_adapter", json={"lora_name": "fortytwo"})
    assert unloaded.status_code == 200
    assert api.adapters() == {}
    assert [card.id for card in api.client.models.list().data] == [api.base_id]
    assert api.text() == api.base_first


def test_a_server_keeping_adapters_in_float16_answers_as_trained(
    model_dir: Path, trained_adapters: TrainedAdapters
):
    """`--adapter-dtype float16`: each adapter holds half the memory, and answers as trained,
    alone and beside the other adapter in one batch."""
    spec = hotlora_spec(
        "--model", str(model_dir), "--adapter-dtype", "float16",
        *trained_adapters.serve_args("pirate", "fortytwo"),
    )  # fmt: skip
    with ServerProcess(spec) as server:
        half = Api(server, model_dir.name)
        try:
            for name, card in half.adapters().items():  # half the files' float32 bytes
                stored = mx.load(str(trained_adapters[name] / "adapters.safetensors")).values()
                assert card["ram_bytes"] * 2 == sum(array.nbytes for array in stored)
            assert half.text("pirate") == PIRATE and half.text("fortytwo") == FORTYTWO
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(half.text, ["pirate", "fortytwo"] * 2))
            assert answers == [PIRATE, FORTYTWO] * 2
        finally:
            half.http.close()
