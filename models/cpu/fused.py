"""Llama's attention and MLP on packed weights in fewer operations: one product for q, k and v.

MLX's CPU backend pays to schedule each operation of a step, and at a few rows that is much of
a step's time; each product also wakes the kernels' threads. `FusedAttention` computes a
layer's q, k and v projections as one primitive (`quant_matmul_heads`) that writes them in the
attention's [B, heads, L, head_dim] layout, so the three reshapes and transposes go too, rotates
q and k there by the layer's RoPE when it is the native one (`NativeRoPE`, the same bits as its
own two calls), and takes the attention's output in the layout the output projection reads
(`attention_rows_merged`), without the transpose and reshape back. `FusedMLP` computes gate and
up as one primitive, its activation (`llama.swiglu`, its bits) in the same call. `FusedBlock`,
the decoder layer holding both, reads its sublayers as the module's items and hands each its
norm (`after_norm`), which the products' call applies to its input first where the norm is the
native one (`NativeRMSNorm`, its bits): a layer's two norms take no primitive of their own.
Every product is the packed kernel's, on the same rows, so the results are the same bits as the
separate layers' (in any batch and any chunking, as those are). A decode step's call of the
layer is one primitive (`layer_step`, the native `decoder_layers`): those calls, the KV cache's
write, the attention and the residual adds in one task, to their bits; and `FusedModel`, the
llama model holding the layers, takes the step of four layers at a time as one primitive
(`layers_step`), checking their arguments in one pass: the embedded model's step is eight of
them where it was thirty, its graph built in ~0.4 ms where a primitive a layer took ~1.05.

A layer takes the fused path when its projections are packed (`PackedLinear`), with no bias,
and each call's projections share a group size and a precision (`_one_call`: their bits and
layouts may differ, as in a GGUF's quant mix). While an adapter set is active (one for the
batch, or one per row), the same primitive adds each projection's residuals to its product,
every projection's in one pass (the gathered kernel's, to the bits its LoRA slot's own call
gives: the batch's plan and each projection's slot number); where that kernel does not serve
(adapters in other dtypes than float32 and float16), each projection is called on its own,
through its slot. What the layer asks of a projection is `FusedProjection`, declared here: the
LoRA slots implement it, so this module knows nothing of adapters.
Only mlx-lm's llama module (llama, mistral and the models it builds) takes these classes; the
other families keep their own attention and MLP on the packed layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, cast, runtime_checkable
from weakref import WeakKeyDictionary

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from hotlora.models.cpu import changes, extension
from hotlora.models.cpu.attention import (
    cache_step_mask,
    call_shared,
    merged_rows_attention,
    step_mask,
)
from hotlora.models.cpu.changes import Watched
from hotlora.models.cpu.layers import NativeRMSNorm, NativeRoPE, PackedLinear

# The gathered kernel's operands of the residuals a projection adds: the batch's plan (its
# adapters' pairs and each row's entries) and the projection's slot number in those pairs.
Gather = tuple[object, int]

# A projection's residuals on one call of a fused product: the gathered kernel's operands; None
# where no adapter applies to it; False where the fused kernel does not add them.
Residuals = Gather | Literal[False] | None


@runtime_checkable
class FusedProjection(Protocol):
    """What a fused layer asks of each projection it computes together with its neighbours:
    a packed layer (`PackedLinear`), or whatever wraps one to add residuals to its product."""

    def fused_layer(self) -> PackedLinear | None:
        """The packed layer whose product the fused kernel computes for this projection; None
        where it cannot (a bias, residuals it never adds). What it depends on is the layers'
        structure alone: a decoder layer's steps keep it while `changes.count()` stays."""
        ...

    def fused_residuals(self, x: mx.array) -> Residuals:
        """The residuals to add to this call's product (see `Residuals`)."""
        ...

    @staticmethod
    def active_residuals() -> object | None:
        """What a projection of this class adds the residuals of in the running call, None
        where it has none to add: where no class of a step's projections has, the step asks
        none of them (`fused_residuals`), ~0.1 ms of a one-row step's graph. An object that can
        be weakly referenced, whose projections' `fused_residuals` stay the same while it lives
        (and the layers count no change): a decode step asks them once for it and keeps their
        answers while it lives (~0.6 ms of a 16-row step's graph under 16 adapters)."""
        ...


def fused_products(
    x: mx.array,
    projections: Sequence[nn.Module],
    heads: list[int],
    rope: tuple[NativeRoPE, mx.array] | None = None,
    norm: nn.Module | None = None,
    glu: bool = False,
) -> list[mx.array] | None:
    """`projection(x)` for each of `projections` as one primitive, or None when the fused path
    does not take them (see the module's docstring). x [B, L, K] float32; output j is
    [B, heads[j], L, out_j / heads[j]] (the attention's layout), or [B, L, out_j] for 0. A
    projection whose adapters apply gets their residuals in the same call, the same bits as its
    LoRA slot's own call. `rope`: a RoPE and its positions (`NativeRoPE.positions`) that the
    first two outputs (q and k) are rotated by in the same call, its bits. `norm`: a
    `NativeRMSNorm` of float32 weights that x goes through first, in the same call, its bits
    (None where the norm is another kind: the caller applies it). `glu`: gate and up give one
    output, `llama.swiglu` of the two, its bits."""
    native = extension.native
    if native is None or x.ndim != 3 or x.dtype != mx.float32 or x.size == 0:
        return None
    found = [cast(FusedProjection, p).fused_layer() for p in projections]
    if any(layer is None for layer in found):
        return None
    layers = cast(list[PackedLinear], found)
    first = layers[0]
    # Arrays read as the module's items: an attribute (`layer.weight`) first fails the
    # object's own lookup, ~2 us a read, and a step makes hundreds.
    weights = [layer["weight"] for layer in layers]
    if not _one_call(layers, weights):
        return None
    residuals = _call_residuals(projections, x)
    if residuals is None:
        return None
    plan, slots = residuals
    return native.quant_matmul_heads(
        x,
        weights,
        [layer["scales"] for layer in layers],
        [layer["biases"] for layer in layers],
        heads,
        first.group_size,
        [layer.bits for layer in layers],
        plan,
        slots,
        first.int8_parts,
        **({} if rope is None else _rope_arguments(*rope)),
        **({} if norm is None else {"norm": norm["weight"], "norm_eps": norm.eps}),
        glu=glu,
    )


def _call_residuals(
    projections: Sequence[nn.Module], x: mx.array
) -> tuple[object | None, list[int]] | None:
    """The residuals of one fused call of `projections` on x: the batch's plan and each
    projection's slot number in it (-1: none apply), or (None, []) where no adapter applies to
    any; None where the fused kernel does not add them (a projection refuses, or two plans)."""
    plan: object | None = None
    slots: list[int] = []
    for j, projection in enumerate(projections):
        operands = cast(FusedProjection, projection).fused_residuals(x)
        if operands is None:
            continue
        if operands is False:
            return None
        if not slots:
            plan, slots = operands[0], [-1] * len(projections)
        elif operands[0] is not plan:  # one active batch plans every projection of a call
            return None
        slots[j] = operands[1]
    return plan, slots


def _one_call(layers: Sequence[PackedLinear], weights: Sequence[mx.array]) -> bool:
    """Whether packed layers (their weights read as items) can be one call of products: one
    group size and precision, and on int8 activations, which the call quantizes once, one order
    of their codes (`_reads_halves`). Their bits, layouts and scales' dtypes may differ, as a
    GGUF's quant mix has them (q and k Q4_K, v Q6_K, say)."""
    first = layers[0]
    halves = _reads_halves(first, weights[0])
    return all(
        (layer.group_size, layer.int8_parts) == (first.group_size, first.int8_parts)
        and (not first.int8_parts or _reads_halves(layer, weight) == halves)
        for layer, weight in zip(layers, weights, strict=True)
    )


def _reads_halves(layer: PackedLinear, weight: mx.array) -> bool:
    """Whether the layer's integer products read x's int8 codes evens first, then odds: MLX's
    4-bit packing, not interleaved (the native `reads_halves`)."""
    return layer.bits == 4 and weight.dtype == mx.uint32


def _rope_arguments(rope: NativeRoPE, positions: mx.array) -> dict[str, Any]:
    """`quant_matmul_heads`'s offset, roped, dims, traditional, base and scale for q and k."""
    return {
        "offset": positions,
        "roped": 2,
        "rope_dims": rope.dims,
        "rope_traditional": rope.traditional,
        "rope_base": rope.base,
        "rope_scale": rope.scale,
    }


def takes_norm(norm: nn.Module, x: mx.array) -> bool:
    """Whether the fused products can apply `norm` to x themselves: the native RMSNorm on float32
    weights, the width of x."""
    return _takes_norm(norm, x.shape[-1])


def _takes_norm(norm: nn.Module, width: int) -> bool:
    if type(norm) is not NativeRMSNorm:
        return False
    weight = norm["weight"]
    return weight.dtype == mx.float32 and weight.shape == (width,)


class FusedAttention(llama.Attention, Watched):
    """mlx-lm's llama attention with q, k and v as one product, in the attention's layout, and
    the attention's output in the output projection's; otherwise mlx-lm's own call."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        return self.after_norm(x, None, mask, cache)

    def after_norm(
        self, x: mx.array, norm: nn.Module | None, mask: mx.array | None, cache: Any
    ) -> mx.array:
        """`self(norm(x), mask, cache)`, the norm in the products' call where they take it."""
        if norm is not None and not takes_norm(norm, x):
            x, norm = norm(x), None
        projections = [self["q_proj"], self["k_proj"], self["v_proj"]]  # items: see above
        kv_heads = self.n_kv_heads or self.n_heads  # ModelArgs sets it; None reads as all
        heads = [self.n_heads, kv_heads, kv_heads]
        rope = self["rope"]
        offset = 0 if cache is None else cache.offset
        rotated = None  # q and k rotated in the product's call: see `fused_products`
        if type(rope) is NativeRoPE and rope.dims % 2 == 0 and 0 < rope.dims <= self.head_dim:
            positions = NativeRoPE.positions(offset, x.shape[0])
            rotated = None if positions is None else (rope, positions)
        qkv = fused_products(x, projections, heads, rotated, norm)
        if qkv is None:
            return super().__call__(x if norm is None else norm(x), mask, cache)
        queries, keys, values = qkv  # [B, heads, L, head_dim] each
        if rotated is None:
            queries = rope(queries, offset=offset)
            keys = rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = merged_rows_attention(queries, keys, values, cache, self.scale, mask)
        if output is None:  # the architecture module's own attention function
            batch, length, _ = x.shape
            output = llama.scaled_dot_product_attention(
                queries, keys, values, cache=cache, scale=self.scale, mask=mask
            )
            output = output.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return self["o_proj"](output)


class FusedMLP(llama.MLP, Watched):
    """mlx-lm's llama MLP with gate and up as one product; otherwise mlx-lm's own call."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.after_norm(x, None)

    def after_norm(self, x: mx.array, norm: nn.Module | None) -> mx.array:
        """`self(norm(x))`, the norm in the products' call where they take it."""
        if norm is not None and not takes_norm(norm, x):
            x, norm = norm(x), None
        projections = [self["gate_proj"], self["up_proj"]]
        activated = fused_products(x, projections, [0, 0], norm=norm, glu=True)
        if activated is None:
            return super().__call__(x if norm is None else norm(x))
        return self["down_proj"](activated[0])


class FusedBlock(llama.TransformerBlock, Watched):
    """mlx-lm's llama decoder layer, its sublayers read as the module's items (see
    `fused_products`), each norm inside the products it feeds where they take it; the same
    operations in the same order. A decode step's call is one primitive where `layer_step`
    takes it."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        stepped = layer_step(self, x, mask, cache)
        if stepped is not None:
            return stepped
        attention, mlp = self["self_attn"], self["mlp"]
        h = x + attention.after_norm(x, self["input_layernorm"], mask, cache)
        return h + mlp.after_norm(h, self["post_attention_layernorm"])


# A decoder layer's projections in `decoder_operands`' order, and its four calls of them.
_LAYER_PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)
_LAYER_CALLS = ((0, 3), (3, 4), (4, 6), (6, 7))


def layer_step(block: FusedBlock, x: mx.array, mask: Any, cache: Any) -> mx.array | None:
    """`block(x, mask, cache)` for a decode step (one token a row) as one primitive
    (`decoder_layers` of one layer), or None where it does not take the call: x float32
    [B, 1, D], mlx-lm's `KVCache` or `BatchKVCache` of float32 with room for the step, the
    native norms and RoPE, and each call of projections (q, k and v; o; gate and up; down) fused
    as `fused_products` fuses them, adapters included. The primitive computes what the layer's
    separate calls do, to their bits, and writes the step's keys and values into the cache as
    its update does."""
    return _steps([block], x, mask, [cache])


def _stepped(cache: Any, kind: type, offset: int | mx.array) -> None:
    """The cache's count after a step that made cache.keys and cache.values the updated arrays."""
    if kind is KVCache:
        cache.offset += 1
    else:
        cache.offset = _next_offsets(cast(mx.array, offset))
        cache._idx += 1


def layers_step(
    blocks: Sequence[nn.Module], x: mx.array, mask: Any, caches: Sequence[Any]
) -> mx.array | None:
    """The decoder layers' calls of a decode step one after another (each `layer_step`'s) as
    a primitive for each `LAYERS_A_CALL` of them (`decoder_layers`), their arguments checked in
    one pass, or None where it does not take the call: every block a `FusedBlock` that
    `layer_step` takes, every cache of one kind at one position, and one adapters' plan for
    all. The same bits as the layers' own steps."""
    return _steps(blocks, x, mask, caches)


def _steps(
    blocks: Sequence[nn.Module], x: mx.array, mask: Any, caches: Sequence[Any]
) -> mx.array | None:
    native = extension.native
    if native is None or x.ndim != 3 or x.shape[1] != 1 or x.dtype != mx.float32:
        return None
    if not blocks or len(blocks) != len(caches):
        return None
    first = caches[0]
    kind = type(first)
    if kind is KVCache:
        at = offset = first.offset
    elif kind is BatchKVCache:
        at, offset = first._idx, first.offset
    else:
        return None
    kept = _StepArguments.of(blocks, x.shape[-1])
    if kept is None:
        return None
    for cache in caches:
        if type(cache) is not kind:
            return None
        if kind is KVCache:
            if cache.offset != at:
                return None
        elif cache._idx != at:  # its offsets the first's: see `_next_offsets`
            return None
        layer_keys, layer_values = cache.keys, cache.values
        if layer_keys is None or at >= layer_keys.shape[2]:
            return None
        if layer_keys.dtype != mx.float32 or layer_values.dtype != mx.float32:
            return None
    plan: object | None = None
    slots: list[list[int]] = []
    active = {id(of): of for residuals in kept.active_residuals if (of := residuals()) is not None}
    if active:
        # One class's residuals (the LoRA slots'): their operands kept while their object lives.
        of = next(iter(active.values())) if len(active) == 1 else None
        found = None if of is None else kept.residuals.get(of)
        if found is None:
            for arguments in kept.layers:
                residuals = _call_residuals(arguments.projections, x)
                if residuals is None:
                    return None
                layer_plan, layer_slots = residuals
                if layer_slots:
                    if plan is None:
                        plan = layer_plan
                    elif layer_plan is not plan:  # one active batch plans every layer
                        return None
                slots.append(layer_slots)
            if of is not None:
                kept.residuals[of] = (plan, slots)
        else:
            plan, slots = found
    inputs = _step_inputs(mask, offset, at, x.shape[0])
    if inputs is None:
        return None
    keys = [cache.keys for cache in caches]
    values = [cache.values for cache in caches]
    out = native.decoder_layers(
        x, kept.operands, keys, values, at, *inputs, plan, slots if plan is not None else [],
        LAYERS_A_CALL,
    )  # fmt: skip
    for cache in caches:
        _stepped(cache, kind, offset)
    return cast(mx.array, out)


class _StepArguments:
    """What `_steps` takes of a run of blocks that stays from step to step: each block's
    `_LayerArguments` and the classes of their projections (`active_residuals`), gathered while
    the watched layers count no change and the blocks and the inputs' width are the same, and
    the residuals' operands (the plan and each layer's slots) for each object of residuals a
    step has found active, while it lives. Kept on the first block."""

    def __init__(self, blocks: tuple[nn.Module, ...], ids: tuple[int, ...], width: int):
        self.changes = changes.count()
        # The blocks after the first held, so that their ids stay theirs (the first holds this:
        # it is alive while it is read, and holding it here would make a cycle).
        self.others = blocks[1:]
        self.ids = ids
        self.width = width
        found = [
            _LayerArguments.of(block, width) if type(block) is FusedBlock else None
            for block in blocks
        ]
        self.takes = all(arguments is not None for arguments in found)
        self.layers = cast(list[_LayerArguments], found)
        if not self.takes:
            return
        self.operands = [arguments.operands for arguments in self.layers]
        classes = {type(p) for arguments in self.layers for p in arguments.projections}
        self.active_residuals = tuple(
            cast(FusedProjection, cls).active_residuals for cls in classes
        )
        self.residuals: WeakKeyDictionary[object, tuple[object | None, list[list[int]]]] = (
            WeakKeyDictionary()
        )

    @classmethod
    def of(cls, blocks: Sequence[nn.Module], width: int) -> _StepArguments | None:
        """The blocks' arguments for inputs `width` wide (gathered anew where a watched layer
        changed since they were), or None where a block does not take the primitive."""
        holder = blocks[0].__dict__
        kept: _StepArguments | None = holder.get("_step_arguments")
        ids = tuple(map(id, blocks))  # modules compare by their items: ids here
        if kept is None or (kept.changes, kept.width, kept.ids) != (changes.count(), width, ids):
            kept = cls(tuple(blocks), ids, width)
            holder["_step_arguments"] = kept
        return kept if kept.takes else None


# The layers of one primitive of `decoder_layers` in `layers_step`. MLX gives each of a primitive's
# outputs (here a layer's keys and values, two a layer) its own copy of the inputs' list (two a
# layer) and of its siblings', so a call's cost grows as the square of its layers. The embedded
# model's one-row step (30 layers, LoRA slots installed) built its graph in 0.67-0.69 ms at two
# to four layers a call, 0.77-0.80 ms at five to eight, 0.90 at thirty, 0.78 at one; evaluated
# it in the same time, within ~0.3 ms, at any of those.
LAYERS_A_CALL = 4


class _LayerArguments:
    """What `decoder_layers` takes of a block that stays from step to step: its projections,
    their packed layers' weights and quantization, its norms, its attention's shape and RoPE.
    Gathered and checked once, kept on the block while the watched layers count no change
    (`changes`: a precision set again, weights loaded, a projection replaced gather them anew)
    and its inputs are as wide."""

    def __init__(self, block: FusedBlock, width: int):
        self.changes = changes.count()  # before anything is read: a change meanwhile counts
        self.width = width
        attention = block["self_attn"]  # items: see `fused_products`
        self.projections = tuple(block[m][p] for m, p in _LAYER_PROJECTIONS)
        found = [cast(FusedProjection, p).fused_layer() for p in self.projections]
        norm1, norm2 = block["input_layernorm"], block["post_attention_layernorm"]
        rope = attention["rope"]
        self.takes = (
            all(layer is not None for layer in found)
            and _takes_norm(norm1, width)
            and _takes_norm(norm2, width)
            and type(rope) is NativeRoPE
            and rope.dims % 2 == 0
            and 0 < rope.dims <= attention.head_dim
        )
        if not self.takes:
            return
        layers = cast(list[PackedLinear], found)
        codes = [layer["weight"] for layer in layers]
        self.takes = all(_one_call(layers[a:b], codes[a:b]) for a, b in _LAYER_CALLS)
        if not self.takes:
            return
        calls = [layers[first] for first, _ in _LAYER_CALLS]
        scales = [layer["scales"] for layer in layers]
        biases = [layer["biases"] for layer in layers]
        mx.eval(codes, scales, biases, norm1["weight"], norm2["weight"])  # the steps read them
        # The native operands of every step, checked once (`decoder_operands`).
        self.operands = extension.native.decoder_operands(
            codes,
            scales,
            biases,
            [layer.bits for layer in layers],
            [layer.group_size for layer in calls],
            [layer.int8_parts for layer in calls],
            norm1["weight"],
            norm2["weight"],
            norm1.eps,
            norm2.eps,
            attention.n_heads,
            attention.n_kv_heads or attention.n_heads,
            attention.scale,
            rope.dims,
            rope.traditional,
            rope.base,
            rope.scale,
        )

    @classmethod
    def of(cls, block: FusedBlock, width: int) -> _LayerArguments | None:
        """The block's arguments for inputs `width` wide, gathered anew where a watched layer
        changed since they were; None where the layer does not take the primitive."""
        kept: _LayerArguments | None = block.__dict__.get("_layer_arguments")
        if kept is None or kept.changes != changes.count() or kept.width != width:
            kept = cls(block, width)
            block.__dict__["_layer_arguments"] = kept
        return kept if kept.takes else None


def _once_a_call(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """make(), kept under `key` for the other layers of the running call (`call_shared`)."""
    shared = call_shared()
    if shared is None:
        return make()
    if key not in shared:
        shared[key] = make()
    return shared[key]


class CacheMask:
    """A decode step's mask as mlx-lm makes it from `cache` for inputs `x`
    (`create_attention_mask`), left for `_step_inputs` to make: where the decoder layers'
    primitive takes the step, the kernels make it (`cache_step_mask`), else mlx-lm."""

    def __init__(self, x: mx.array, cache: Any):
        self.x, self.cache = x, cache

    def made(self) -> Any:
        """mlx-lm's mask."""
        return create_attention_mask(self.x, self.cache)


def _step_inputs(
    mask: Any, offset: int | mx.array, at: int, batch: int
) -> tuple[mx.array, mx.array] | None:
    """The attention kernel's mask (`step_mask`; of a `CacheMask`, the kernels' own where they
    make it) and the positions (`NativeRoPE.positions`) of a decode step of `batch` rows
    writing position `at`, or None where the kernels do not take them; made once a call: every
    layer's cache of one call is at the same offset (see `_next_offsets`) and takes the call's
    mask. An array offset or mask is known by its id, and kept beside what was made of it while
    the call holds them."""
    key = (
        "step",
        mask if mask is None or isinstance(mask, str) else id(mask),
        offset if isinstance(offset, int) else id(offset),
        at,
        batch,
    )

    def make() -> tuple[Any, Any, tuple[mx.array, mx.array] | None]:
        if isinstance(mask, CacheMask):
            kernel_mask = cache_step_mask(mask.cache, batch, at + 1)
            if kernel_mask is None:
                kernel_mask = step_mask(mask.made(), batch, at + 1)
        else:
            kernel_mask = step_mask(mask, batch, at + 1)
        positions = NativeRoPE.positions(offset, batch)
        taken = None if kernel_mask is None or positions is None else (kernel_mask, positions)
        return mask, offset, taken

    return cast(tuple[mx.array, mx.array] | None, _once_a_call(key, make)[2])


def _next_offsets(offsets: mx.array) -> mx.array:
    """offsets + 1, computed once a call: the layers' batch caches of one model call hold the same
    offsets (mlx-lm merges, extends, filters and trims them layer by layer alike, and builds
    every layer's mask from the first's), so they share the first layer's next ones."""
    return cast(mx.array, _once_a_call(("next offsets",), lambda: offsets + 1))


class FusedModel(llama.LlamaModel, Watched):
    """mlx-lm's llama model whose decoder layers take a decode step as one primitive where
    `layers_step` takes it (every layer full attention); otherwise mlx-lm's own call."""

    def __call__(
        self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        tokens = inputs if input_embeddings is None else input_embeddings
        full = getattr(self, "fa_idx", None)  # None: the call not as mlx-lm 0.32 makes it
        if (
            cache is None
            or full is None
            or getattr(self, "swa_idx", None) is not None
            or tokens.ndim < 2
            or tokens.shape[1] != 1
        ):
            return super().__call__(inputs, cache, input_embeddings)
        h = self["embed_tokens"](inputs) if input_embeddings is None else input_embeddings
        stepped = layers_step(self["layers"], h, CacheMask(h, cache[full]), cache)
        if stepped is None:  # refused before anything was made: mlx-lm's own call
            return super().__call__(inputs, cache, input_embeddings)
        return cast(mx.array, self["norm"](stepped))


_FUSED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    llama.Attention: FusedAttention,
    llama.MLP: FusedMLP,
}

# Each fused class's projections, in the order it computes them together.
_PROJECTIONS = {
    FusedAttention: ("q_proj", "k_proj", "v_proj"),
    FusedMLP: ("gate_proj", "up_proj"),
}


def install_fused(model: nn.Module) -> int:
    """Give the model's llama attention and MLP layers their fused class, in place, where each
    projection they compute together is a `FusedProjection` (packed, or a LoRA slot on packed
    weights); returns how many layers changed. Their projections and weights are untouched."""
    changed = 0
    for _, module in model.named_modules():
        fused = _FUSED_CLASSES.get(type(module))
        if fused is None:
            continue
        if all(isinstance(module[name], FusedProjection) for name in _PROJECTIONS[fused]):
            module.__class__ = fused
            changed += 1
    for _, module in model.named_modules():
        if type(module) is llama.TransformerBlock and (
            isinstance(module["self_attn"], FusedAttention) and isinstance(module["mlp"], FusedMLP)
        ):
            module.__class__ = FusedBlock
    for _, module in model.named_modules():
        if type(module) is llama.LlamaModel and any(
            type(layer) is FusedBlock for layer in module["layers"]
        ):
            module.__class__ = FusedModel
    changes.changed()  # the classes swapped were not watched
    return changed


def uninstall_fused(model: nn.Module) -> int:
    """Give every fused layer of the model its mlx-lm class back, in place (`install_fused`
    undone); returns how many layers changed."""
    changed = 0
    for _, module in model.named_modules():
        if isinstance(module, FusedAttention | FusedMLP | FusedBlock | FusedModel):
            module.__dict__.pop("_layer_arguments", None)  # the weights its operands hold
            module.__dict__.pop("_step_arguments", None)
            if not isinstance(module, FusedModel):  # a layer
                changed += 1
            module.__class__ = type(module).__mro__[1]
    return changed
