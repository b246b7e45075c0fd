"""Structured output: JSON schemas, regular expressions, choices and grammars (Lark, GBNF) compiled
to grammars that mask each constrained row's logits.

The grammar engine is llguidance. Of the three engines that compile JSON schemas to token masks,
xgrammar needs PyTorch at import; outlines-core and llguidance install as plain wheels.
outlines-core reads its precomputed masks faster, but first compiles every schema into a token
automaton on the request's path, which takes seconds for a small nested schema and far longer
for "any JSON object"; llguidance compiles a schema quickly and computes a row's mask in a small
fraction of a decode step (the README's structured output section has the figures). llguidance
also covers more of JSON Schema, and names the keyword it cannot enforce.

A compiled `Grammar` is kept per schema text (LRU); each row decoding under it starts its own
`Constraint` (a copy of the compiled matcher), so the `n` choices of a request and rows of any
requests batched together each follow their own place in their own grammar.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from hotlora.config.errors import HotloraError, InvalidRequest
from hotlora.server.engine.tokens import TokenPieces

log = logging.getLogger("hotlora")

# JSON as the model writes it: no free whitespace, which a small model can repeat until
# `max_tokens` runs out. Overrides win over a schema's own `x-guidance` options, and a keyword
# the engine cannot enforce is refused rather than ignored.
_JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
# Schemas larger than this are refused before they are compiled. A long literal (a `const`, an
# `enum` value) costs the lexer time on every constrained decode step in proportion to its
# length, and past a few hundred KB the lexer runs out of fuel partway through the answer.
MAX_SCHEMA_BYTES = 64 * 1024
# Errors that never quote the grammar: a refusal's message goes to the client and to the log.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


# Where a refused schema came from: how its error names it, and the request field.
_Source = tuple[str, str]
_TOOL_PARAMETERS: _Source = ("A tool's parameters", "tools")
# Schema keywords whose values are schemas (one, a list, or a map of them) that closing reaches.
# `allOf` is left as written: closing each branch would refuse the keys the others add.
_ONE_SCHEMA = ("items", "additionalProperties", "additionalItems", "contains", "not")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_MAX_CLOSING_DEPTH = 64
# Text that cannot be mistaken for the generic format's calls: empty, or not beginning with `{`
# or whitespace. The start of a Lark grammar whose answer is `calls` or such text, and one whose
# answer is only such text.
_TEXT = "text: TEXT?\nTEXT: /[^{\\s](.|\\n)*/\n"
_CALLS_OR_TEXT = "start: calls | text\n" + _TEXT
_ONLY_TEXT = "start: text\n" + _TEXT
# A Lark grammar's `start` rule, renamed where the grammar becomes one branch of another.
_START_RULE = re.compile(r"^start:", re.MULTILINE)
# How llguidance begins a Lark error: the line and column in the grammar ("at 4(8): ").
_GRAMMAR_PLACE = re.compile(r"^at \d+\(\d+\): ")
_QUOTED_LINE = re.compile(r"^\s+\d+ \| ")  # "   4 | calls: %json {...": a line of the grammar
_MARKUP = re.compile(r"<[a-z-]+/>")  # "<non-verbose/>": a tag of llguidance's own log


class UnsupportedSchema(InvalidRequest):
    """A `response_format` schema (or a tool's parameters) that is not valid or uses what the
    grammar engine lacks; `param` names the request field it came in (OpenAI's code for a
    tool's: `invalid_function_parameters`)."""

    code = "invalid_response_format"
    param = "response_format"

    def __init__(self, message: str, *, param: str, kind: str):
        super().__init__(message, param=param)
        if param == _TOOL_PARAMETERS[1]:
            self.code = "invalid_function_parameters"
        self.kind = kind  # what the log says of it: the schema's text never reaches the log


class GrammarFailed(HotloraError):
    """A row's matcher went into an error state: it stops, the rest of the batch goes on. The
    constraint compiled, but following it went past the grammar engine's limits (counted
    repetitions nested a thousand deep): the request's to simplify, a 400."""

    code = "grammar_failed"


# What llguidance says when a grammar outgrows its limits (`lexer error: too many expressions
# constructed`, `parser error: Too many items (limit 50000; ...)`): the request's to simplify.
_LIMIT_WORDS = ("too many", "limit")


def _failure(error: str) -> Exception:
    """The error a row's failed matcher ends it with: a grammar past the engine's limits is
    the request's (a 400); anything else (a token the mask allowed and the matcher refused) is
    the server's (a 500, logged with its traceback)."""
    said = _in_words(error)  # its own words, not the grammar's lines it quotes
    if any(word in said.lower() for word in _LIMIT_WORDS):
        return GrammarFailed(
            "The answer's constraint (response_format, a guided_* field, a grammar or a "
            "tool's parameters) could not be followed: the grammar engine reached one of its "
            f"limits ({said}); make it smaller, e.g. fewer or shorter counted repetitions"
        )
    return RuntimeError(f"Generation left the answer's grammar: {error}")


def _in_words(error: str) -> str:
    """llguidance's reason, said for a client where it names only its own internals, on one
    line: without the place in a Lark grammar the client may never have written (a tool's
    parameters sit in a grammar of the whole answer) and the grammar's lines it quotes after."""
    lines = _GRAMMAR_PLACE.sub("", _MARKUP.sub("", error).strip()).splitlines()
    quoted = next((i for i, line in enumerate(lines) if _QUOTED_LINE.match(line)), len(lines))
    error = " ".join(line.strip() for line in lines[:quoted] if line.strip())
    if "NoExtensionBias" in error:  # no token can begin anything the grammar admits
        return (
            "it admits no text this model's vocabulary can write (a pattern that matches "
            "nothing, or characters no token of the vocabulary spells)"
        )
    return error


class Constraint:
    """One row's place in its grammar: which tokens may come next, and when it is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self._matcher = matcher
        self._words = words  # 32-bit words of the matcher's mask

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed-next-token bits into `row` (int32 [>= words], contiguous)."""
        row[:] = 0
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, self._words * 4)

    def consume(self, token: int) -> None:
        """Advance past a generated token; a token the grammar refuses leaves `error` set."""
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end of the answer may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class Grammar:
    """A compiled, validated grammar: rows start their own `Constraint` from it."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self._pristine = matcher
        self._words = words

    def start(self) -> Constraint:
        return Constraint(self._pristine.deep_copy(), self._words)


class Grammars:
    """JSON schemas compiled for one tokenizer, the last `cache_size` of them kept.

    The grammar engine's token table takes seconds to build for a large vocabulary: it is built
    on the first compile, so a server that never sees a `response_format` never pays for it.
    Compiles run off the event loop (on the tokenizer's thread); the lock keeps the table and
    the cache whole if they ever run elsewhere too.
    """

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        vocab_size: int,
        pieces: TokenPieces,
        special_ids: frozenset[int],
        *,
        cache_size: int = 32,
    ):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._pieces = pieces
        self._special_ids = special_ids
        self._cache_size = cache_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._table: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def json_schema(
        self, schema: dict[str, Any], *, param: str = "response_format", closed: bool = True
    ) -> Grammar:
        """The grammar of JSON text that validates against `schema`; `UnsupportedSchema` if
        the schema is invalid or uses a feature the engine cannot enforce. `closed`: objects
        that list `properties` and do not say `additionalProperties` take no other keys, as in
        OpenAI's strict mode and vLLM."""
        source = (f"The {param} schema", param)
        text = _schema_text(close_objects(schema) if closed else schema, source)
        compile_json = llguidance.LLMatcher.grammar_from_json_schema
        return self._cached(
            f"json:{text}", lambda: compile_json(text, overrides=_JSON_OPTIONS), source
        )

    def output(self, kind: str, value: Any, param: str, *, closed: bool = True) -> Grammar:
        """The grammar of an output constraint by its kind: `json` (a schema), `regex`,
        `choice` (a list of strings) or `grammar` (Lark or GBNF text); `param` names the
        request field it came in."""
        if kind == "json":
            return self.json_schema(value, param=param, closed=closed)
        if kind == "regex":
            return self.regex(value, param=param)
        if kind == "choice":
            return self.choice(value, param=param)
        return self.grammar(value, param=param)

    def regex(self, pattern: str, *, param: str) -> Grammar:
        """The grammar of text that matches `pattern` whole (Rust's regex syntax)."""
        source = (f"The {param} regular expression", param)
        return self._cached(
            f"regex:{pattern}", lambda: llguidance.grammar_from("regex", pattern), source
        )

    def choice(self, options: list[str], *, param: str) -> Grammar:
        """The grammar of exactly one of `options`."""
        source = (f"The {param} list", param)
        lark = "start: " + " | ".join(json.dumps(option) for option in options)
        return self._cached(lark, lambda: llguidance.LLMatcher.grammar_from_lark(lark), source)

    def grammar(self, text: str, *, param: str) -> Grammar:
        """The grammar `text` defines: Lark as llguidance reads it (a `start:` rule), else
        llama.cpp's GBNF (a `root ::=` rule), converted to Lark."""
        source = (f"The {param} grammar" if param != "grammar" else "The grammar", param)
        return self._cached(
            f"grammar:{text}", lambda: llguidance.grammar_from("grammar", text), source
        )

    def tagged_call_lark(self, start: str, end: str, schema: dict[str, Any]) -> str:
        """Lark text for one tool call as `start` JSON `end`, the JSON valid under `schema` (the
        call's name and arguments), for `tool_lark`: how `tool_choice` required or named is
        enforced in a family whose calls are tagged."""
        return (
            f'start: {self.literal(start)} "\\n"? call "\\n"? {self.literal(end)}\n'
            f"call: {self.json_rule(schema)}\n"
        )

    def tool_lark(self, lark: str) -> Grammar:
        """A tool-call grammar in Lark, built from `json_rule` and `literal` pieces: how
        `tool_choice` required or named is enforced in a model family's own format."""
        return self._cached(
            lark, lambda: llguidance.LLMatcher.grammar_from_lark(lark), _TOOL_PARAMETERS
        )

    @staticmethod
    def json_rule(schema: dict[str, Any]) -> str:
        """A Lark expression for JSON valid under `schema` (objects closed), written as the
        model writes JSON here; `UnsupportedSchema` (param `tools`) for NaN or Infinity."""
        closed = close_objects(schema)
        return f"%json {_schema_text({**closed, 'x-guidance': _JSON_OPTIONS}, _TOOL_PARAMETERS)}"

    def literal(self, text: str) -> str:
        """A Lark expression for `text` as the model writes it: the special token it is (say,
        Mistral's `[TOOL_CALLS]`), which a quoted string would not match, or the string."""
        ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        if len(ids) == 1 and ids[0] in self._special_ids:
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def tool_answer(self, schema: dict[str, Any], *, text: bool) -> Grammar:
        """The grammar of an answer that is JSON valid under `schema` (the generic format's
        calls) or, when `text`, plain text that begins with neither `{` nor whitespace (or is
        empty): how tools are held to on a model whose template cannot show them."""
        return self.tool_lark(self.generic_calls_lark(schema, text=text))

    def generic_calls_lark(self, schema: dict[str, Any], *, text: bool = False) -> str:
        """`tool_answer`'s grammar as Lark text."""
        head = _CALLS_OR_TEXT if text else "start: calls\n"
        return f"{head}calls: {self.json_rule(schema)}\n"

    def calls_or_json(
        self, calls: str, schema: dict[str, Any], *, param: str, closed: bool = True
    ) -> Grammar:
        """The grammar of an answer that is either the tool calls of `calls` (Lark text whose
        `start` rule is the calls, as `tool_lark` takes) or JSON valid under `schema` (the
        `param` field's): how `tool_choice` auto is held to beside a `response_format`, which
        holds an answer that calls nothing. The schema is compiled alone first, so that its
        refusal names `param`; any other refusal names `tools`. Each part is held to the size
        limit on its own."""
        self.json_schema(schema, param=param, closed=closed)
        if (size := len(calls.encode())) > MAX_SCHEMA_BYTES:
            raise UnsupportedSchema(
                f"The tools' grammar is {size} bytes; this server compiles at most "
                f"{MAX_SCHEMA_BYTES}.",
                param="tools",
                kind="too large",
            )
        shown = close_objects(schema) if closed else schema
        if isinstance(shown, dict):  # the schema's own options, ours over them (`json_schema`)
            options = shown.get("x-guidance")
            shown = {**shown, "x-guidance": {**(options or {}), **_JSON_OPTIONS}}
        body = _schema_text(shown, (f"The {param} schema", param))
        tool_calls = _START_RULE.sub("tool_calls:", calls, count=1)
        lark = f"start: tool_calls | format_answer\n{tool_calls}format_answer: %json {body}\n"
        return self._cached_compile(
            lark, lambda: llguidance.LLMatcher.grammar_from_lark(lark), _TOOL_PARAMETERS
        )

    def plain_text(self) -> Grammar:
        """The grammar of an answer that may call no tool in a conversation that shows calls in
        the generic format: text that cannot begin as the calls' object does (or is empty)."""
        return self._cached(
            _ONLY_TEXT,
            lambda: llguidance.LLMatcher.grammar_from_lark(_ONLY_TEXT),
            _TOOL_PARAMETERS,
        )

    def _cached(self, key: str, definition: Callable[[], str], source: _Source) -> Grammar:
        """The grammar kept under `key`, or the one `definition` gives, compiled and kept; a
        refusal is logged by the schema's size and the kind of problem, never its text."""
        subject, param = source
        size = len(key.encode())
        if size > MAX_SCHEMA_BYTES:
            log.info("refused %s of %d bytes: over %d bytes", param, size, MAX_SCHEMA_BYTES)
            raise UnsupportedSchema(
                f"{subject} is {size} bytes as JSON; this server compiles schemas of at most "
                f"{MAX_SCHEMA_BYTES} bytes.",
                param=param,
                kind="too large",
            )
        try:
            return self._cached_compile(key, definition, source)
        except UnsupportedSchema as exc:
            log.info("refused %s of %d bytes: %s", param, size, exc.kind)
            raise

    def _cached_compile(self, key: str, definition: Callable[[], str], source: _Source) -> Grammar:
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
            grammar = self._compile(definition, source)
            self._cache[key] = grammar
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return grammar

    def _compile(self, definition: Callable[[], str], source: _Source) -> Grammar:
        table = self._token_table()
        subject, param = source
        try:
            text = definition()
        except ValueError as exc:
            raise UnsupportedSchema(
                f"{subject} is not valid: {exc}.", param=param, kind="not valid"
            ) from exc
        matcher = llguidance.LLMatcher(table, text, log_level=0, limits=_LIMITS)
        if not matcher.is_error():
            # The first mask builds what every row's first step needs (shared by the copies):
            # built here, off the decode loop, and a lexer that cannot build it is refused now.
            matcher.compute_bitmask()
        if matcher.is_error():
            raise UnsupportedSchema(
                f"{subject} cannot be enforced: {_in_words(matcher.get_error())}.",
                param=param,
                kind="cannot be enforced",
            )
        return Grammar(matcher, _words(table.vocab_size))

    def _token_table(self) -> llguidance.LLTokenizer:
        if self._table is None:
            self._table = self._build_table()
        return self._table

    def _build_table(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, at least as wide as the model's logits."""
        hf = self._tokenizer._tokenizer
        eos = sorted(self._tokenizer.eos_token_ids)
        n_vocab = max(self._vocab_size, len(hf))
        try:
            return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos)
        except ValueError:
            # A decoder llguidance does not read (e.g. `Fuse`): give it each token's bytes.
            words = _TokenBytes(hf, self._pieces, self._special_ids, eos[0])
            wrapper = llguidance.TokenizerWrapper(words)
            return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)


def close_objects(schema: Any, depth: int = 0) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists
    `properties` and says nothing of other keys; an object without `properties` stays open (it
    would admit only `{}`), and `allOf` branches stay as written."""
    if not isinstance(schema, dict) or depth > _MAX_CLOSING_DEPTH:
        return schema
    out = dict(schema)
    open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if isinstance(out.get("properties"), dict) and not any(key in out for key in open_keys):
        out["additionalProperties"] = False
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key], depth + 1)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(item, depth + 1) for item in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(item, depth + 1) for name, item in out[key].items()}
    return out


def _schema_text(schema: dict[str, Any], source: _Source) -> str:
    """`schema` as JSON text, its key order kept (the answer's key order follows it)."""
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        subject, param = source
        message = f"{subject} holds NaN or Infinity, which JSON cannot carry: {exc}."
        raise UnsupportedSchema(message, param=param, kind="not valid") from exc


class _TokenBytes:
    """A tokenizer as llguidance's `TokenizerWrapper` reads one: every token's exact bytes."""

    def __init__(self, hf: Any, pieces: TokenPieces, special_ids: frozenset[int], eos: int):
        self._hf = hf
        self.eos_token_id = eos
        self.bos_token_id = getattr(hf, "bos_token_id", None)
        self.tokens = [pieces(i).bytes for i in range(len(hf))]
        self.special_token_ids = sorted(special_ids)
        self._unknown = getattr(hf, "unk_token_id", None)

    def __call__(self, text: str) -> list[int]:
        # Text spelling a special token ("<unk>", "<|im_end|>") is that text, not the token.
        ids = list(self._hf.encode(text, add_special_tokens=False, split_special_tokens=True))
        # The unknown token stands for text no token spells, and spells other bytes: no
        # tokenization of `text` (llguidance then knows the vocabulary cannot write it).
        return [] if self._unknown is not None and self._unknown in ids else ids


def constrain(
    logits: mx.array, constraints: Sequence[Constraint | None], failed: dict[int, Exception]
) -> mx.array:
    """`logits` [B, vocab] with every token a row's grammar does not allow next set to -inf.

    Rows without a constraint come back as they went in (bit for bit). A row whose matcher
    has failed is added to `failed` and left unmasked. The masks are computed one row after
    another into one array: llguidance's thread pool (`LLExecutor`) was slower on 2 cores.
    """
    batch, vocab = logits.shape
    words = max(_words(vocab), *(c._words for c in constraints if c is not None))
    bitmask = np.full((batch, words), -1, dtype=np.int32)  # [B, words]: bit t = token t allowed
    for i, constraint in enumerate(constraints):
        if constraint is None or i in failed:
            continue
        if constraint.error:
            failed[i] = _failure(constraint.error)
            continue
        constraint.fill(bitmask[i])
    # Token t is bit t % 32 of word t // 32: in a little-endian int32, byte-wise little bit order.
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
    allowed = mx.array(bits.view(np.bool_))  # [B, vocab]
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


def _words(vocab: int) -> int:
    return (vocab + 31) // 32
