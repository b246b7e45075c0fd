"""The app's runtime: loads the base model once, warms it, and holds the services built on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx

from hotlora.adapters import AdapterManager, Budget, MountStore, mount_file
from hotlora.config.errors import ModelNotFound
from hotlora.config.log_text import one_line
from hotlora.config.settings import Settings
from hotlora.models.cpu import give_back_freed_memory, prepare_cpu
from hotlora.models.cpu.weights import has_gpu
from hotlora.models.embedded import (
    embedded_model_path,
    ensure_embedded_model,
    ensure_model,
    imported_gguf_path,
    names_gguf_file,
)
from hotlora.models.end_of_generation import describe, token_text
from hotlora.models.loader import LoadedModel, generation_defaults, load_model_dir
from hotlora.server.api.admin_models import EndOfGenerationToken, ModelCard
from hotlora.server.embedding import EmbeddingService
from hotlora.server.engine import (
    Engine,
    GenerationJob,
    GenerationWorker,
    LoadSnapshot,
    SamplingParams,
    WorkerStopped,
    check_batching,
)
from hotlora.server.http.request_errors import NotReady
from hotlora.server.render.chat_templates import install_chat_template
from hotlora.server.serving import InferenceService
from hotlora.server.telemetry.prometheus import Metrics
from hotlora.server.tokenizing import TokenizingService

log = logging.getLogger("hotlora")

PHASE_NOTICE_SECONDS = 2.0  # a start-up phase running this long logs that it is under way
_LAST_WRITE_S = 5.0  # after the drain, how long ended requests get to write their answer


def model_dir(settings: Settings, progress: Callable[[str], None] | None = None) -> Path:
    """The directory to serve: `settings.model`, the import of it when it is a GGUF file (by
    its suffix or its first bytes), or the embedded model; GGUF files are imported once into
    the home."""
    if settings.model is None:
        return ensure_embedded_model(settings.home, progress=progress)
    return ensure_model(settings.model, settings.home, progress=progress)


def base_model_id(settings: Settings) -> str:
    """The id the base model is served under: `served_model_name`, else its directory's name."""
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model is not None:
        path = settings.model.expanduser().resolve()
        return path.stem if names_gguf_file(settings.model) else path.name
    return embedded_model_path(settings.home).name


class Runtime:
    """Everything built on the loaded base model; `ready` once loaded and warmed."""

    def __init__(
        self,
        settings: Settings,
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        mount_store: MountStore | None = None,
    ):
        self.settings = settings
        self.started_at = int(time.time())
        self.worker: GenerationWorker | None = None
        self.inference: InferenceService | None = None
        self.tokenizing: TokenizingService | None = None
        self.embeddings: EmbeddingService | None = None
        self.base_id: str | None = None
        self.model_path: Path | None = None
        self.adapters: AdapterManager | None = None
        # Where the mounted set outlives this process: the one given (a Ray replica's link to
        # the cluster's registry), else the mount record of --persist-mounts.
        if mount_store is None:
            mount_store = mount_file(settings)
        self.mount_store = mount_store
        self.ready = False
        self.status = "starting"
        self.draining = False
        self.hurried = False  # a second signal: the drain ends the requests in flight now
        self.in_flight = 0  # HTTP requests being answered, streams until their last event
        self.phases: dict[str, float] = {}  # start-up phase -> seconds it took
        self.metrics = Metrics()
        self.metrics.model_name = settings.served_model_name or ""
        self.metrics.watch(self)
        self._on_fatal = on_fatal

    async def start(self) -> None:
        """Load, build the services, warm up; a failure is fatal for the server."""
        try:
            loop = asyncio.get_running_loop()
            began = time.perf_counter()
            self.status = "loading model"
            importing = self._phase("model import") if self._imports_model() else None
            with importing or contextlib.nullcontext():
                path = await loop.run_in_executor(None, model_dir, self.settings, self._progress)
            with self._phase("model load"):
                loaded = await loop.run_in_executor(None, load_model_dir, path)
            await loop.run_in_executor(None, self._build, loaded, path)
            assert self.worker is not None
            self.worker.start()
            self.status = "warming up"
            await self._warm_up()
            # Batch sizes of served requests only: the warm-up's are not traffic.
            self.worker.scheduler.on_decode = self.metrics.decoded
            self.ready, self.status = True, "ready"
            took = time.perf_counter() - began
            log.info("ready: serving %s from %s (started in %.2fs)", self.base_id, path, took)
        except Exception as exc:  # noqa: BLE001 - reported, then the server stops
            self.status = "failed"
            log.error("could not start: %s", one_line(exc))
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _progress(self, message: str) -> None:
        self.status = message
        log.info("%s", message)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Time one start-up phase; the log and GET /metrics report how long it took. A phase
        still running after PHASE_NOTICE_SECONDS says so in the log, once."""
        began = time.perf_counter()
        notice = threading.Timer(PHASE_NOTICE_SECONDS, self._under_way, (name,))
        notice.daemon = True
        notice.start()
        try:
            yield
        finally:
            notice.cancel()
        took = time.perf_counter() - began
        self.phases[name] = took
        fields = {"phase": name, "seconds": round(took, 3)}
        log.info("start-up: %s took %.2fs", name, took, extra={"fields": fields})

    @staticmethod
    def _under_way(phase: str) -> None:
        log.info("still starting: %s under way after %gs", phase, PHASE_NOTICE_SECONDS)

    def _imports_model(self) -> bool:
        """The embedded model or a GGUF file is served and not imported yet: this start
        imports it."""
        home, model = self.settings.home, self.settings.model
        if model is None:
            dest = embedded_model_path(home)
        elif names_gguf_file(model):
            dest = imported_gguf_path(home, model.expanduser().resolve())
        else:
            return False
        return not (dest / "config.json").is_file()

    def _build(self, loaded: LoadedModel, path: Path) -> None:
        install_chat_template(loaded, self.settings.chat_template)
        eog = loaded.end_of_generation
        log.info(
            "end of generation: %s",
            describe(eog, loaded.tokenizer),
            extra={"fields": {"end_of_generation": list(eog)}},
        )
        # Without a GPU: float32 weights when they fit, MLX's JIT flags, the native kernels;
        # the log says which and why. The fast path keeps to this model's fidelity verdict.
        setup = prepare_cpu(
            loaded.model,
            weights=self.settings.cpu_weights,
            float_budget=self.settings.cpu_float_budget_bytes,
            cache_bytes=self.settings.cpu_cache_bytes,
            vector_jit=self.settings.cpu_vector_jit,
            batch_kernels=self.settings.cpu_native_kernels,
            precision=self.settings.cpu_precision,
            model_dir=path,
            home=self.settings.home,
            converting=self._converting,
            threads=self.settings.threads,
            isa=self.settings.cpu_kernels_isa,
        )
        # What the load and the packing freed (tens of MB of glibc's heap on a 0.8B model) goes
        # back to the system before the first request, rather than staying resident under it.
        give_back_freed_memory()
        max_batch = self._max_batch(loaded)
        self.model_path = path
        self.base_id = base_model_id(self.settings)  # `path`'s name, unless named otherwise
        self.metrics.model_name = self.base_id
        self.adapters = AdapterManager(
            loaded.model,
            base_id=self.base_id,
            adapter_root=self.settings.resolved_adapter_root,
            max_rank=self.settings.max_adapter_rank,
            max_bytes=self.settings.max_adapter_bytes,
            journal=self.mount_store,
            listeners=[self.metrics.adapter_changed],
            budget=Budget(self.settings.max_mounted_adapters, self.settings.adapter_memory_bytes),
            auto_mount=self.settings.auto_mount,
            adapter_dtype=self._adapter_dtype(setup.packed),
        )
        if self.mount_store is not None:
            with self._phase("adapter restore"):
                self.mount_store.restore(self.adapters)
        if self.settings.startup_adapters:
            with self._phase("adapter mounts"):
                for adapter_id, adapter_path in self.settings.startup_adapters.items():
                    self.adapters.mount(adapter_id, adapter_path)
        engine = Engine(
            loaded,
            base_id=self.base_id,
            prompt_cache_size=self.settings.prompt_cache_size,
            prompt_cache_bytes=self.settings.prompt_cache_bytes,
            prompt_heads=self.settings.prompt_heads,
            prompt_heads_bytes=self.settings.prompt_heads_bytes,
        )
        self.worker = GenerationWorker(
            engine,
            max_queue=self.settings.queue_size,
            max_unsent=self.settings.max_unsent_tokens,
            max_batch=max_batch,
            prefill_chunk=self.settings.prefill_chunk,
            prefill_context_unit=self.settings.prefill_context_unit,
            kv_cache_bytes=self.settings.kv_cache_bytes,
            before_step=self.adapters.yield_to_loads,
            look_ahead=decodes_ahead(self.settings.decode_ahead),
        )
        self.inference = InferenceService(
            self.worker,
            self.settings,
            adapters=self.adapters,
            generation_defaults=generation_defaults(path),
            metrics=self.metrics,
        )
        self.tokenizing = TokenizingService(self.inference)
        self.embeddings = EmbeddingService(self.inference)

    def _adapter_dtype(self, packed: bool) -> mx.Dtype:
        """`kept_adapter_dtype`, said in the log where float16 was asked and is left aside."""
        asked = self.settings.adapter_dtype
        kept = kept_adapter_dtype(asked, packed)
        if asked == "float16" and kept != mx.float16:
            log.warning(
                "--adapter-dtype float16 applies to packed 4-bit weights on the CPU: adapters "
                "are kept in float32 here"
            )
        return kept

    def _max_batch(self, loaded: LoadedModel) -> int:
        """`max_batch`, or 1 when the model as served (its CPU kernels installed) fails the
        batching check: one row at a time is slower, never wrong."""
        if self.settings.max_batch == 1:
            return 1
        with self._phase("batching check"):
            failed = check_batching(loaded.model)
        if failed is None:
            return self.settings.max_batch
        architecture = loaded.config.get("model_type", type(loaded.model).__module__)
        log.warning(
            "batching off for %s: %s; requests decode one row at a time",
            architecture,
            failed,
            extra={"fields": {"architecture": architecture, "reason": failed}},
        )
        return 1

    def _converting(self, reason: str) -> contextlib.AbstractContextManager[None]:
        """The float32 conversion's progress line, timed as a start-up phase."""
        self._progress(f"converting the weights to float32 ({reason})")
        return self._phase("float32 conversion")

    async def _warm_up(self) -> None:
        if not self.settings.warmup or self.worker is None:
            return
        prompt = list(self.worker.engine.tokenizer.encode("Hello", add_special_tokens=False))
        job = GenerationJob(prompt or [0], SamplingParams(max_tokens=2, temperature=0.0))
        with self._phase("warm-up"):
            async for _ in self.worker.events(self.worker.submit([job])):
                pass

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; let those in flight finish for up to `timeout` seconds (or until
        `hurry`), then end them (`WorkerStopped`: a 503, or a stream's error event before
        `[DONE]`)."""
        self.draining, self.ready, self.status = True, False, "shutting down"
        loop = asyncio.get_running_loop()
        log.info("shutting down: %s in flight, waiting up to %gs", self._in_flight(), timeout)
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline and not self.hurried:
            await asyncio.sleep(0.05)
        if self.in_flight:
            why = "a second signal" if self.hurried else "drain timeout"
            log.warning("%s: ending %s still in flight", why, self._in_flight())
        if self.worker is not None:
            await self.worker.stop()
        # The ended requests write their last bytes; a client that does not read them is cut.
        deadline = loop.time() + _LAST_WRITE_S
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def _in_flight(self) -> str:
        return f"{self.in_flight} request{'' if self.in_flight == 1 else 's'}"

    def hurry(self) -> None:
        """Cut the drain's wait short: the requests in flight are ended at once."""
        self.hurried = True

    async def stop(self) -> None:
        if self.inference is not None:
            self.inference.close()
        if self.worker is not None:
            await self.worker.stop()

    def load_snapshot(self) -> LoadSnapshot:
        """What the generation worker holds now; all zeros before it is built."""
        return self.worker.load_snapshot() if self.worker is not None else LoadSnapshot()

    def model_cards(self) -> list[ModelCard]:
        """The base model; adapters follow it with `parent` set to the base id."""
        assert self.base_id is not None and self.adapters is not None
        assert self.worker is not None
        context = self.worker.engine.context_length
        loaded = self.worker.engine.loaded
        ends = [
            EndOfGenerationToken(id=i, token=token_text(loaded.tokenizer, i), sources=list(why))
            for i, why in loaded.end_of_generation.items()
        ]
        base = ModelCard(
            id=self.base_id,
            created=self.started_at,
            owned_by="hotlora",
            root=str(self.model_path),
            max_model_len=context,
            end_of_generation=ends,
        )
        adapters = [
            ModelCard(
                id=info.id,
                created=info.mounted_at,
                owned_by="hotlora",
                root=info.path,
                parent=self.base_id,
                max_model_len=context,
                end_of_generation=ends,
            )
            for info in self.adapters.list()
        ]
        return [base, *adapters]

    def model_card(self, model_id: str) -> ModelCard:
        self.require_inference()
        for card in self.model_cards():
            if card.id == model_id:
                return card
        raise ModelNotFound(model_id, [card.id for card in self.model_cards()])

    def require_adapters(self) -> AdapterManager:
        self._check_serving()
        assert self.adapters is not None
        return self.adapters

    def require_inference(self) -> InferenceService:
        self._check_serving()
        assert self.inference is not None
        return self.inference

    def require_tokenizing(self) -> TokenizingService:
        self._check_serving()
        assert self.tokenizing is not None
        return self.tokenizing

    def require_embeddings(self) -> EmbeddingService:
        self._check_serving()
        assert self.embeddings is not None
        return self.embeddings

    def _check_serving(self) -> None:
        if self.draining:
            raise WorkerStopped("The server is shutting down; retry on another replica.")
        if not self.ready or self.inference is None:
            raise NotReady(f"The model is not ready yet ({self.status}).")


def kept_adapter_dtype(asked: str, packed: bool) -> mx.Dtype:
    """What adapters are kept in where the activations are float32, for `--adapter-dtype
    asked`: float16 where the packed kernels serve (they read it as exactly as float32) unless
    float32 is asked; float32 elsewhere (MLX's own layers would convert float16 back at every
    call)."""
    return mx.float16 if packed and asked != "float32" else mx.float32


def decodes_ahead(asked: str) -> bool:
    """Whether the scheduler launches each decode step before reading the last one's tokens,
    for `--decode-ahead asked`: auto launches ahead where the model runs on a GPU (the host
    builds a step while the device computes the one before) and not on the CPU, whose cores the
    step's kernels already keep busy."""
    return asked == "on" or (asked == "auto" and has_gpu())
