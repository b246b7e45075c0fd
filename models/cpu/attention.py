"""mlx-lm's attention on the CPU, in the one place that points its architecture files at it.

mlx-lm's architecture files call `scaled_dot_product_attention` as a module global. MLX's CPU
attention is a composition of ops whose softmax is one uncompiled kernel; on float32
`cpu_attention` computes the same composition, bit for bit, with the exponentials compiled (fast
once `vector_jit` has given MLX's JIT the vector flags). With the native kernels loaded,
`rows_attention` wraps whichever function a module had: a batched decode step's attention,
about twenty operations a layer, two of them BLAS products of a few rows, becomes one primitive
that reads each row's cached keys and values once (within rounding of MLX); a prefill chunk's
keeps MLX's BLAS products, but the softmax between them, five single-threaded passes over a
chunk's scores (which deep in a long prompt are tens of megabytes a layer), is one threaded
primitive (`masked_softmax`) with MLX's results to the bit. A model served by the quantized
weights' kernels takes the attention kernel on every call, a request alone and each prompt chunk
too: each query token is then computed on its own, the same bits in any batch or chunking.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import BatchKVCache, KVCache

from hotlora.models.cpu import extension

MaskedSoftmax = Callable[[mx.array, mx.array], mx.array]


@mx.compile
def _shifted_exp(scores: mx.array, maximum: mx.array) -> mx.array:
    return mx.exp(scores - maximum)


@mx.compile
def _normalized(exps: mx.array, total: mx.array) -> mx.array:
    return exps * (1 / total)


def softmax(scores: mx.array) -> mx.array:
    """`mx.softmax(scores, axis=-1, precise=True)` on float32, bit for bit, exponentials fused."""
    exps = _shifted_exp(scores, mx.max(scores, axis=-1, keepdims=True))
    return _normalized(exps, mx.sum(exps, axis=-1, keepdims=True))


def cpu_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
    *,
    masked_softmax: MaskedSoftmax | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` as MLX computes it on the CPU, with `softmax`.

    The steps are those of `mx.fast.scaled_dot_product_attention`'s CPU path (MLX's
    `mlx/fast.cpp`), with the same results bit for bit. Float32 only, without sinks or a
    quantized KV cache; anything else goes to mlx-lm's own function. `masked_softmax`, when
    given, computes `softmax(where(mask, scores, lowest))` for a bool mask of the scores' shape
    to the same bits in one operation (the native kernels' `masked_softmax`).
    """
    if (
        hasattr(cache, "bits")
        or sinks is not None
        or any(a.dtype != mx.float32 for a in (queries, keys, values))
    ):
        return mlx_lm_base.scaled_dot_product_attention(
            queries,
            keys,
            values,
            cache=cache,
            scale=scale,
            mask=mask,  # type: ignore[arg-type]  # mlx-lm passes "causal" too
            sinks=sinks,
        )
    batch, n_heads, q_len, _ = queries.shape
    n_kv_heads, kv_len = keys.shape[1], keys.shape[2]
    repeats = n_heads // n_kv_heads
    q = queries * mx.array(scale, dtype=queries.dtype)
    if repeats > 1:
        # The query heads sharing a KV head as a broadcast batch of products, as MLX groups
        # them: one product of all their rows would take other BLAS kernels, and other bits.
        q = q.reshape(batch, n_kv_heads, repeats, q_len, -1)  # [B, n_kv_heads, repeats, L, D]
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = q @ mx.swapaxes(keys, -1, -2)  # [B, n_kv_heads, (repeats,) L, S]
    if isinstance(mask, str):  # "causal": query i sees keys up to its own position
        q_idx = mx.arange(kv_len - q_len, kv_len)[:, None]
        mask = q_idx >= mx.arange(kv_len)[None]
    elif mask is not None:  # [B, n_heads, L, S], as MLX broadcasts it
        if mask.dtype != mx.bool_:
            mask = mask.astype(scores.dtype)
        mask = mx.broadcast_to(mask, (batch, n_heads, q_len, kv_len))
    if mask is not None:
        if repeats > 1 and mask.ndim >= 3:
            mask = mask.reshape(*mask.shape[:-3], n_kv_heads, repeats, *mask.shape[-2:])
        if mask.dtype == mx.bool_ and masked_softmax is not None:
            probabilities = masked_softmax(scores, mx.broadcast_to(mask, scores.shape))
            return (probabilities @ values).reshape(batch, n_heads, q_len, -1)
        if mask.dtype == mx.bool_:
            lowest = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
            scores = mx.where(mask, scores, lowest)
        else:
            scores = scores + mask
    return (softmax(scores) @ values).reshape(batch, n_heads, q_len, -1)


def install_cpu_attention(model: nn.Module) -> list[str]:
    """Point the model's architecture modules at `cpu_attention`; returns the modules changed.

    mlx-lm's architecture files call `scaled_dot_product_attention` as a module global; a
    module whose global is anything but mlx-lm's own function is left alone."""
    changed = []
    for module, current in attention_globals(model):
        if current is mlx_lm_base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = cpu_attention  # type: ignore[attr-defined]
            changed.append(module.__name__)
    return changed


def attention_globals(model: nn.Module) -> Iterator[tuple[ModuleType, Any]]:
    """The modules of the model's classes that have a `scaled_dot_product_attention` global
    (mlx-lm's architecture files call it as one), each with its current value."""
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if module is not None and current is not None:
            yield module, current


# Set while a model with the kernels installed runs, on the thread that runs it: the attention
# function is a module global of mlx-lm's architecture files, shared by every model of the
# process, and only those models' steps may take the kernel.
_running = threading.local()


class _RowsModel(nn.Module):
    """Mixed into an installed model's own class: its calls let `rows_attention` serve."""

    rows_mode: bool | str = True  # "all": every call takes the kernel, not batched steps only

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _rows_call(self.rows_mode):
            return super().__call__(*args, **kwargs)


@contextmanager
def _rows_call(mode: bool | str) -> Iterator[None]:
    """A call of an installed model, whose layers `rows_attention` serves as `mode` says."""
    outer = getattr(_running, "rows", False), getattr(_running, "masks", None)
    _running.rows = mode
    _running.masks = {}  # what this call's layers share: `call_shared`
    try:
        yield
    finally:
        _running.rows, _running.masks = outer


def parts_of(model: nn.Module) -> AbstractContextManager[None]:
    """Within it, a call of a part of `model` (its body without the head, as embeddings run it)
    takes the attention kernel as a call of the whole model does: where the model takes it on
    every call, each query token computed on its own, the same bits in any chunking."""
    if isinstance(model, _RowsModel):
        return _rows_call(model.rows_mode)
    return nullcontext()


_ROWS_MODELS: dict[tuple[type[nn.Module], bool], type[nn.Module]] = {}


def _rows_model_class(cls: type[nn.Module], all_rows: bool) -> type[nn.Module]:
    if issubclass(cls, _RowsModel):
        cls = cls.__mro__[2]  # the model's own class, under the mixin
    key = (cls, all_rows)
    if key not in _ROWS_MODELS:
        attributes = {"__module__": cls.__module__, "rows_mode": "all" if all_rows else True}
        _ROWS_MODELS[key] = type(cls.__name__, (_RowsModel, cls), attributes)
    return _ROWS_MODELS[key]


Attention = Callable[..., mx.array]


def _kernel_mask(queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> mx.array | None:
    """The bool mask [B, 1, L, S] for the attention kernel when an installed model's call takes
    it, else None: a batched decode step's (float32 queries [B, H, 1, D], keys and values
    [B, Hkv, S, *], a bool mask [B, 1, 1, S]); for a model of quantized kernels every call's,
    whatever its rows and tokens, with no mask, "causal" or a bool one."""
    mode = getattr(_running, "rows", False)
    if mode == "all":
        return _any_call_mask(queries, keys, values, mask)
    if not (mode and extension.one_token_rows(queries, 4)):
        return None
    return mask if _fits(queries, keys, values, mask) else None


def _any_call_mask(
    queries: mx.array, keys: mx.array, values: mx.array, mask: Any
) -> mx.array | None:
    if extension.native is None or queries.ndim != 4 or queries.dtype != mx.float32:
        return None
    batch, _, length, _ = queries.shape
    span = keys.shape[2] if keys.ndim == 4 else 0
    built = _call_mask(mask, (batch, 1, length, span))
    return built if built is not None and _fits(queries, keys, values, built) else None


def _call_mask(mask: Any, shape: tuple[int, int, int, int]) -> mx.array | None:
    """The call's mask (None, "causal" or a bool array) as a bool [B, 1, L, S] of `shape`, or
    None where it is another kind or does not broadcast to it."""
    span, length = shape[3], shape[2]
    # Every layer of a call builds the same mask from the call's: one array for all. An array
    # is known by its id while the call holds it (and the entry too).
    built: dict[tuple[Any, ...], Any] | None = getattr(_running, "masks", None)
    given = mask
    key = (mask if mask is None or isinstance(mask, str) else id(mask), shape)
    if built is not None and key in built:
        return cast(mx.array, built[key][1])
    if mask is None:
        mask = mx.array(True)
    elif isinstance(mask, str):
        if mask != "causal":
            return None
        mask = mx.arange(span - length, span)[:, None] >= mx.arange(span)[None]  # [L, S]
    elif not (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim <= 4):
        return None
    try:
        mask = mx.broadcast_to(mask, shape)
    except ValueError:
        return None
    if built is not None:
        built[key] = (given, mask)
    return mask


def call_shared() -> dict[tuple[Any, ...], Any] | None:
    """What the layers of an installed model's running call share, by key (its masks, a decode
    step's cache offsets); None outside such a call."""
    return cast(dict[tuple[Any, ...], Any] | None, getattr(_running, "masks", None))


def step_mask(mask: Any, batch: int, span: int) -> mx.array | None:
    """The attention kernel's bool mask [B, 1, 1, S] for a decode step (one token a row) of a
    model whose every call takes the kernel (a model of quantized kernels), from the call's
    mask; None where that model is not running or the mask is another kind."""
    if getattr(_running, "rows", False) != "all":
        return None
    return _call_mask(mask, (batch, 1, 1, span))


def cache_step_mask(cache: Any, batch: int, span: int) -> mx.array | None:
    """`step_mask` of the mask mlx-lm makes for a decode step of `batch` rows from `cache`
    (`create_attention_mask`, the cache at its last position, `span` keys), made by the kernels
    in one operation (`step_key_mask`) where mlx-lm's `create_causal_mask` takes up to nine: a
    `KVCache`'s every key, a `BatchKVCache`'s each row's keys from its left padding on. None
    where that model is not running or the cache is another kind (make mlx-lm's mask then)."""
    native = extension.native
    if native is None or getattr(_running, "rows", False) != "all":
        return None
    kind = type(cache)
    if kind is KVCache:
        return cast(mx.array, native.step_key_mask(batch, span))
    if kind is not BatchKVCache:
        return None
    padding = cache.left_padding
    if padding.dtype != mx.int32 or padding.shape != (batch,):
        return None
    return cast(mx.array, native.step_key_mask(batch, span, padding))


def _fits(queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> bool:
    batch, heads, length, width = queries.shape
    return (
        keys.ndim == 4
        and values.ndim == 4
        and keys.dtype == values.dtype == mx.float32
        and keys.shape[0] == values.shape[0] == batch
        and keys.shape[1] == values.shape[1]
        and heads % keys.shape[1] == 0
        and keys.shape[2] == values.shape[2]
        and keys.shape[3] == width
        and keys.shape[2] > 0
        and isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.shape == (batch, 1, length, keys.shape[2])
    )


def rows_attention(fallback: Attention) -> Attention:
    """mlx-lm's `scaled_dot_product_attention` for an architecture module: a batched decode
    step of an installed model through the attention kernel; its other calls (prefill chunks,
    a request decoding alone) to `fallback`, whose masked softmax, when it is `cpu_attention`,
    takes the `masked_softmax` primitive (the same bits)."""

    def attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        kernel_mask = (
            None
            if sinks is not None or hasattr(cache, "bits")
            else _kernel_mask(queries, keys, values, mask)
        )
        if kernel_mask is not None:
            assert extension.native is not None
            return extension.native.attention_rows(queries, keys, values, kernel_mask, scale)
        native = extension.native
        if fallback is cpu_attention and native is not None and getattr(_running, "rows", False):
            # Prefill chunks: the masked softmax as one primitive, to cpu_attention's bits.
            return cpu_attention(
                queries,
                keys,
                values,
                cache=cache,
                scale=scale,
                mask=mask,
                sinks=sinks,
                masked_softmax=native.masked_softmax,
            )
        return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    attention.rows_fallback = fallback  # type: ignore[attr-defined]
    return attention


def merged_rows_attention(
    queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any
) -> mx.array | None:
    """The attention kernel's output as [B, L, H * Dv], the heads side by side as the output
    projection reads them, when the call of an installed model takes the kernel (as
    `rows_attention` decides); else None, and the caller takes its module's own function."""
    if hasattr(cache, "bits"):
        return None
    kernel_mask = _kernel_mask(queries, keys, values, mask)
    if kernel_mask is None:
        return None
    assert extension.native is not None
    return extension.native.attention_rows_merged(queries, keys, values, kernel_mask, scale)


def install_rows_attention(model: nn.Module, all_rows: bool = False) -> list[str]:
    """Point the model's architecture modules at `rows_attention`, over the function they had
    (mlx-lm's, or `cpu_attention`), and let the model's own calls take it (`all_rows`: every
    call, not batched decode steps only); returns the modules that take it (by their last
    name). The kernels serve once `extension.load` has succeeded."""
    served = []
    for module, current in attention_globals(model):
        if current in (mlx_lm_base.scaled_dot_product_attention, cpu_attention):
            module.scaled_dot_product_attention = rows_attention(current)  # type: ignore[attr-defined]
        if hasattr(module.scaled_dot_product_attention, "rows_fallback"):
            served.append(module.__name__.rsplit(".", 1)[-1])
    if served:
        model.__class__ = _rows_model_class(type(model), all_rows)
    return served
