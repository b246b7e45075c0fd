"""The tokenizer rebuilt from GGUF metadata, checked against llama.cpp's own ids, plain reference
BPE and sentencepiece tokenizers, and gguf-py."""

import json
from itertools import pairwise
from pathlib import Path

import pytest
import regex
from gguf import GGUFReader
from mlx_lm.utils import load_tokenizer

from hotlora.models.gguf import read_header
from hotlora.models.gguf_tokenizer import (
    UnsupportedTokenizer,
    build_tokenizer,
    generation_config,
    pre_tokenizer_for,
    special_token_ids,
    write_tokenizer_files,
)
from hotlora.server.engine.tokens import RowDetokenizers, TokenPieces
from hotlora.server.render.echo import echoed_prompts

from tests.support.gguf_files import bytes_to_unicode, embedded_gguf, write_tiny_gguf
from tests.support.gguf_models import SPM_PIECES, spm_vocab, write_family_gguf

TRICKY = [
    "12345",
    "héllo wörld 日本語 🙂",
    "a\tb\n\nc  d\r\n  end ",
    "https://example.com/path?q=1&x=2#frag",
    "<|im_start|>user\nhi<|im_end|>",
    "It's 3.14159 o'clock, isn't it?",
    "def f(x):\n\treturn x**2  # square\n",
    "   ",
]
# llama.cpp's split rules (llama-vocab.cpp), spelled as it spells them.
GPT2_RULE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_RULE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
RULES = {
    "smollm": [r"\p{N}", GPT2_RULE],
    "gpt-2": [GPT2_RULE],
    "llama-bpe": [LLAMA3_RULE],
    "qwen2": [LLAMA3_RULE.replace(r"\p{N}{1,3}", r"\p{N}")],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_RULE, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
BYTE_CHARS = bytes_to_unicode()


def split_like_llama_cpp(text: str, rules: list[str]) -> list[str]:
    """Apply each rule to every piece in turn, keeping matches and the text between them."""
    pieces = [text]
    for rule in rules:
        out = []
        for piece in pieces:
            start = 0
            for m in regex.finditer(rule, piece):
                out += [piece[start : m.start()], m.group()]
                start = m.end()
            out.append(piece[start:])
        pieces = [p for p in out if p]
    return pieces


class ReferenceBPE:
    """Textbook byte-level BPE: split, map bytes to symbols, merge the best-ranked pair first."""

    def __init__(self, meta: dict, rules: list[str]):
        self.tokens = meta["tokenizer.ggml.tokens"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
        types = meta["tokenizer.ggml.token_type"]
        self.special = [t for t, k in zip(self.tokens, types, strict=True) if k == 3]
        self.rules = rules

    def word(self, word: str) -> list[int]:
        parts = [BYTE_CHARS[b] for b in word.encode()]
        while len(parts) > 1:
            rank, i = min(
                (self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(pairwise(parts))
            )
            if rank == float("inf"):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return [self.ids[p] for p in parts]

    def encode(self, text: str) -> list[int]:
        ids = []
        for chunk in regex.split("(" + "|".join(map(regex.escape, self.special)) + ")", text):
            if chunk in self.special:
                ids.append(self.ids[chunk])
            elif chunk:
                for word in split_like_llama_cpp(chunk, self.rules):
                    ids += self.word(word)
        return ids


@pytest.fixture(scope="module")
def meta() -> dict:
    return read_header(embedded_gguf()).metadata


@pytest.fixture(scope="module")
def tokenizer(meta):
    return build_tokenizer(meta)


def test_header_reader_agrees_with_gguf_py(meta):
    reader = GGUFReader(embedded_gguf())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert meta[key] == pytest.approx(field.contents()), key
    header = read_header(embedded_gguf())
    assert {n: (i.type, i.shape) for n, i in header.tensors.items()} == {
        t.name: (t.tensor_type, tuple(reversed(t.shape.tolist()))) for t in reader.tensors
    }
    assert header.data_start == reader.data_offset


@pytest.mark.parametrize("text", TRICKY)
def test_embedded_tokenizer_matches_reference_bpe(meta, tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert ids == ReferenceBPE(meta, RULES["smollm"]).encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
@pytest.mark.parametrize("text", [*TRICKY, "x  \n\n  y 1234567 日本 🙂🙂"])
def test_other_pre_tokenizers_match_reference_bpe_on_a_real_vocabulary(meta, pre, text):
    # Qwen's GGUFs (qwen2, qwen3) name the qwen2 pre-tokenizer; the merges here are SmolLM2's.
    tokenizer = build_tokenizer({**meta, "tokenizer.ggml.pre": pre})
    ids = tokenizer.encode(text).ids
    assert ids == ReferenceBPE(meta, RULES[pre]).encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_digits_and_special_tokens_are_single_tokens(meta, tokenizer):
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    assert tokenizer.encode("12345").ids == [vocab[d] for d in "12345"] == [33, 34, 35, 36, 37]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids == [1, vocab["user"], vocab["Ċ"], vocab["hi"], 2] == [1, 4093, 198, 6004, 2]


def test_written_files_load_in_mlx_lm(meta, tokenizer, tmp_path):
    write_tokenizer_files(meta, tmp_path)
    loaded = load_tokenizer(tmp_path)
    for text in TRICKY:
        assert loaded.encode(text) == tokenizer.encode(text).ids, text
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert loaded.eos_token_id == 2 and loaded.eos_token_ids == {2}
    messages = [{"role": "user", "content": "hi"}]
    prompt = loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_config_files_carry_template_and_special_ids(meta, tmp_path):
    write_tokenizer_files(meta, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == meta["tokenizer.chat_template"]
    assert config["add_bos_token"] is False
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


SAMPLE = "Hello, y'all! We'RE 12345 items\n\n  in 日本語 — x+=3 <= 7 …  \t\r\n 2024-01-01"


@pytest.mark.parametrize("name", sorted(RULES))
def test_pre_tokenizers_split_like_llama_cpp(name):
    pieces = [p for p, _ in pre_tokenizer_for(name).pre_tokenize_str(SAMPLE)]
    expected = split_like_llama_cpp(SAMPLE, RULES[name])
    assert pieces == ["".join(BYTE_CHARS[b] for b in p.encode()) for p in expected]


def test_add_bos_puts_bos_first(meta):
    tokenizer = build_tokenizer({**meta, "tokenizer.ggml.add_bos_token": True})
    assert tokenizer.encode("hi").ids[0] == 1
    assert build_tokenizer(meta).encode("hi").ids[0] != 1


# (vocabulary, tokenizer.ggml.add_bos_token, whether a prompt starts with BOS): llama.cpp's
# default where the key is absent (dbrx splits as llama3 does, yet takes no BOS), the key where
# present.
BOS_CASES = [
    ("sentencepiece", None, True),
    ("sentencepiece", False, False),
    ("llama-bpe", None, True),
    ("llama3", None, True),
    ("dbrx", None, False),
    ("smollm", None, False),
    ("qwen2", None, False),
    ("llama-bpe", False, False),
    ("smollm", True, True),
]


@pytest.mark.parametrize(("vocab", "add_bos", "bos_first"), BOS_CASES)
def test_bos_is_added_where_llama_cpp_adds_it(tmp_path, vocab, add_bos, bos_first):
    if vocab == "sentencepiece":
        write_family_gguf(tmp_path / "m.gguf", "mistral", add_bos=add_bos)
    else:
        write_tiny_gguf(tmp_path / "m.gguf", pre=vocab, add_bos=add_bos)
    write_tokenizer_files(read_header(tmp_path / "m.gguf").metadata, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is bos_first
    assert (load_tokenizer(tmp_path).encode("hi")[0] == 1) is bos_first  # 1: the BOS id


def test_a_sentencepiece_vocabulary_naming_no_special_ids_takes_llama_cpp_s(tmp_path):
    """Without bos, eos and unk ids, a sentencepiece vocabulary's are 1, 2 and 0, as llama.cpp
    takes them: a prompt starts with BOS, generation stops at EOS, unknown text is `<unk>`."""
    write_family_gguf(tmp_path / "m.gguf", "mistral", add_bos=None)
    meta = read_header(tmp_path / "m.gguf").metadata
    named = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    bare = {k: v for k, v in meta.items() if k not in (*named, "tokenizer.ggml.unknown_token_id")}
    assert special_token_ids(bare) == {"bos": 1, "eos": 2, "unk": 0}
    assert build_tokenizer(bare).encode("hi").ids[0] == 1
    assert generation_config(bare) == {"bos_token_id": 1, "eos_token_id": 2}
    # Ids the metadata names win; a BPE vocabulary takes none it does not name.
    assert special_token_ids({**bare, named[1]: 3})["eos"] == 3
    write_tiny_gguf(tmp_path / "b.gguf", pre="llama-bpe")
    bpe = {k: v for k, v in read_header(tmp_path / "b.gguf").metadata.items() if k not in named}
    assert "bos" not in special_token_ids(bpe) and "eos" not in special_token_ids(bpe)


def test_user_defined_tokens_match_whole(meta):
    types = list(meta["tokenizer.ggml.token_type"])
    types[3] = 4  # <repo_name>
    tokenizer = build_tokenizer({**meta, "tokenizer.ggml.token_type": types})
    assert tokenizer.encode("a<repo_name>b").ids == [
        tokenizer.token_to_id("a"),
        3,
        tokenizer.token_to_id("b"),
    ]
    assert tokenizer.decode([3], skip_special_tokens=True) == "<repo_name>"


def test_embedded_tokenizer_json_is_kept_verbatim(meta, tmp_path):
    original = '{"version": "1.0", "model": {"type": "BPE"}}'
    write_tokenizer_files({**meta, "tokenizer.huggingface.json": original}, tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == original


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"tokenizer.ggml.pre": "mystery"}, "pre-tokenizer 'mystery'"),
        ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert'"),
        ({"tokenizer.ggml.model": "llama"}, "needs a score for every token"),
        ({"tokenizer.ggml.merges": ["Ġ zzzz"]}, "merges do not fit"),
    ],
)
def test_unsupported_tokenizers_are_refused(meta, change, words):
    with pytest.raises(UnsupportedTokenizer, match=words):
        build_tokenizer({**meta, **change})


# llama.cpp's vocabulary test for Phi-3 (its models/ggml-vocab-phi-3.gguf, .inp and .out): a
# sentencepiece vocabulary, the strings, and the ids llama.cpp gives each (no BOS, special
# tokens not parsed).
PHI3_VOCAB = Path(__file__).parents[1] / "support" / "vocab" / "ggml-vocab-phi-3.gguf"
SEPARATOR = "\n__ggml_vocab_test__\n"


def llama_cpp_cases() -> list[tuple[str, list[int]]]:
    texts = PHI3_VOCAB.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    lines = PHI3_VOCAB.with_suffix(".gguf.out").read_text(encoding="utf-8").splitlines()
    assert texts.pop() == ""  # the file ends with a separator
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


class ReferenceSPM:
    """llama.cpp's sentencepiece tokenizer (llm_tokenizer_spm) written out plainly: spaces as
    ▁ (one in front unless the model says not), merge the adjacent pair whose joined text is
    the best-scoring piece (leftmost on a tie), bytes for characters outside the vocabulary."""

    def __init__(self, meta: dict):
        self.ids: dict[str, int] = {}
        for i, token in enumerate(meta["tokenizer.ggml.tokens"]):
            self.ids.setdefault(token, i)
        self.scores = meta["tokenizer.ggml.scores"]
        self.add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)

    def encode(self, text: str) -> list[int]:
        if not text:  # llama.cpp has no text fragment to put the ▁ in front of
            return []
        symbols = list((" " + text if self.add_prefix else text).replace(" ", "\u2581"))
        while True:
            best = None
            for i, pair in enumerate(pairwise(symbols)):
                piece = "".join(pair)
                if piece in self.ids and (best is None or self.scores[self.ids[piece]] > best[0]):
                    best = (self.scores[self.ids[piece]], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        ids = []
        for symbol in symbols:
            if symbol in self.ids:
                ids.append(self.ids[symbol])
            else:
                ids += [self.ids[f"<0x{b:02X}>"] for b in symbol.encode()]
        return ids


@pytest.fixture(scope="module")
def phi3_meta() -> dict:
    return read_header(PHI3_VOCAB).metadata


@pytest.fixture(scope="module")
def phi3_tokenizer(phi3_meta):
    return build_tokenizer(phi3_meta)


@pytest.mark.parametrize(
    ("text", "expected"), llama_cpp_cases(), ids=[f"case{i}" for i in range(len(llama_cpp_cases()))]
)
def test_sentencepiece_gives_llama_cpp_s_ids(phi3_meta, phi3_tokenizer, text, expected):
    assert phi3_tokenizer.encode(text, add_special_tokens=False).ids == expected
    assert ReferenceSPM(phi3_meta).encode(text) == expected  # the reference, checked too


# TRICKY without its ChatML line: the Phi-3 vocabulary has no such tokens.
SPM_TRICKY = [t for t in TRICKY if "<|" not in t] + ["Äpfel ﬁ ǅ", "\n\n\n", " leading", "x\u200by"]


@pytest.mark.parametrize("text", SPM_TRICKY)
def test_sentencepiece_without_space_prefix_matches_reference(phi3_meta, text):
    # Gemma's converter writes add_space_prefix false: no ▁ in front of the text.
    meta = {**phi3_meta, "tokenizer.ggml.add_space_prefix": False, "general.name": "gemma"}
    tokenizer = build_tokenizer(meta)
    assert tokenizer.encode(text, add_special_tokens=False).ids == ReferenceSPM(meta).encode(text)
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_sentencepiece_round_trips_and_puts_bos_first(phi3_meta, phi3_tokenizer):
    for text in TRICKY:
        ids = phi3_tokenizer.encode(text).ids
        assert ids[0] == 1  # add_bos_token
        assert phi3_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_phi3_special_tokens_swallow_the_whitespace_after_them(phi3_meta, phi3_tokenizer):
    # llama.cpp strips the whitespace right of Phi-3's special tokens (chosen by the model's
    # name), and starts the text after a special token with ▁.
    vocab = {t: i for i, t in enumerate(phi3_meta["tokenizer.ggml.tokens"])}
    ids = phi3_tokenizer.encode("<|user|>\n hi<|end|>\n<s>\nhi", add_special_tokens=False).ids
    reference = ReferenceSPM(phi3_meta)
    assert ids == [
        vocab["<|user|>"],
        *reference.encode("hi"),
        vocab["<|end|>"],
        vocab["<s>"],
        *reference.encode("\nhi"),
    ]
    plain = build_tokenizer({**phi3_meta, "general.name": "other"})
    assert plain.encode("<|end|>\nhi", add_special_tokens=False).ids == [
        vocab["<|end|>"],
        *reference.encode("\nhi"),
    ]


def test_sentencepiece_files_load_in_mlx_lm(phi3_meta, phi3_tokenizer, tmp_path):
    write_tokenizer_files(phi3_meta, tmp_path)
    loaded = load_tokenizer(tmp_path)
    for text, expected in llama_cpp_cases()[:20]:
        assert loaded.encode(text, add_special_tokens=False) == expected, text
    assert loaded.encode("hi")[0] == 1
    # mlx-lm streams a sentencepiece decoder's text piece by piece.
    detokenizer = loaded.detokenizer
    detokenizer.reset()
    for token in loaded.encode("héllo wörld 🙂", add_special_tokens=False):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == "héllo wörld 🙂"


def test_tiny_sentencepiece_vocab_merges_by_score():
    tokens, scores, types = spm_vocab()
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tokenizer = build_tokenizer(meta)
    ids = {t: i for i, t in enumerate(tokens)}
    # The text's own tokens (llama.cpp puts its default BOS, id 1, before them).
    assert tokenizer.encode("the world").ids == [1, ids["\u2581the"], ids["\u2581world"]]
    assert "\u2581world" in SPM_PIECES
    for text in ("the other words", "in a world of ørder", "12 rather"):
        pieces = tokenizer.encode(text, add_special_tokens=False).ids
        assert pieces == ReferenceSPM(meta).encode(text), text


def streamed(detokenizer, ids: list[int]) -> tuple[str, str]:
    """The text a row's detokenizer gives `ids` streamed, and the same read segment by segment."""
    segments = []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    return detokenizer.text, "".join(segments)


@pytest.mark.parametrize("family", ["bpe", "sentencepiece"])
def test_generated_text_keeps_the_space_it_opens_with(family, meta, phi3_meta, tmp_path):
    """A completion continues its prompt: a first token of " a" is text " a", as its logprobs
    entry says, where mlx-lm's detokenizers drop the space as a whole text's decode does."""
    write_tokenizer_files(meta if family == "bpe" else phi3_meta, tmp_path)
    loaded = load_tokenizer(tmp_path)
    ids = loaded.encode(" a canvas of wörld 🙂", add_special_tokens=False)
    if family == "sentencepiece":  # its space prefix: " a" is one piece, not two
        ids = loaded.encode("a canvas of wörld 🙂", add_special_tokens=False)
    assert loaded.convert_ids_to_tokens(ids[0]) in ("Ġa", "▁a")
    whole, pieces = streamed(RowDetokenizers(loaded)(), ids)
    assert whole == pieces == " a canvas of wörld 🙂"
    assert streamed(loaded.detokenizer, ids)[0] == "a canvas of wörld 🙂"  # mlx-lm's own
    # Every row's detokenizer starts afresh, and a text that opens with no space gains none.
    detokenizers = RowDetokenizers(loaded)
    first, second = detokenizers(), detokenizers()
    streamed(first, ids)
    digits = loaded.encode("2026", add_special_tokens=False)  # a digit a token
    digits = [t for t in digits if loaded.convert_ids_to_tokens(t) != "▁"]  # no space prefix
    assert streamed(second, digits)[0] == "2026"


@pytest.mark.parametrize("family", ["bpe", "sentencepiece"])
def test_token_pieces_join_into_the_generated_text(family, meta, phi3_meta, tmp_path):
    """Each token's logprobs text, its opening space and raw bytes included, joins into the
    text a row's detokenizer streams, so `text_offset`s point at the tokens."""
    write_tokenizer_files(meta if family == "bpe" else phi3_meta, tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "a canvas of wörld 🙂\n x"
    ids = loaded.encode(text, add_special_tokens=False)
    pieces = [TokenPieces(loaded)(token) for token in ids]
    whole, _ = streamed(RowDetokenizers(loaded)(), ids)
    assert b"".join(p.bytes for p in pieces).decode() == whole
    assert whole == (" " if family == "sentencepiece" else "") + text  # its space prefix
    assert pieces[0].text == (" a" if family == "sentencepiece" else "a")
    if family == "sentencepiece":  # 🙂 has no piece of its own: four byte-fallback pieces
        assert [p.bytes for p in pieces if len(p.bytes) == 1 and p.bytes[0] >= 0x80]


@pytest.mark.parametrize("family", ["bpe", "sentencepiece"])
def test_echoed_prompt_offsets_point_into_the_text_sent(family, meta, phi3_meta, tmp_path):
    """An echoed prompt's `text_offset`s index the text as sent: a BOS the tokenizer adds and
    SentencePiece's space prefix take none of it, the bytes of one character start at it, and
    the completion starts after the whole text."""
    write_tokenizer_files(meta if family == "bpe" else phi3_meta, tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "a canvas of wörld 🙂!"
    ids = loaded.encode(text)  # with the BOS where the tokenizer adds one
    assert (ids[0] == loaded.bos_token_id) == (family == "sentencepiece")
    [echoed] = echoed_prompts(loaded, TokenPieces(loaded), [text], [ids], [ids])
    assert echoed.text == text and echoed.length == len(text)
    assert len(echoed.offsets) == len(ids) and list(echoed.offsets) == sorted(echoed.offsets)
    for piece, offset in zip(echoed.pieces, echoed.offsets, strict=True):
        if piece == "<s>" or piece.startswith("bytes:\\x") or not piece.isprintable():
            continue  # the BOS (at 0), a byte of the emoji (at the emoji), a control byte
        assert text[offset:].startswith(piece.lstrip(" ") if offset == 0 else piece), piece
    emoji = text.index("🙂")
    assert echoed.offsets[-1] == emoji + 1  # "!" after the emoji's bytes
    if family == "bpe":  # byte-level: the pieces are the text
        assert "".join(echoed.pieces) == text
    else:  # the emoji's four byte pieces start at it, named by their bytes (as OpenAI's)
        assert echoed.offsets.count(emoji) == 4
        shown = [piece for piece in echoed.pieces if piece.startswith("bytes:")]
        assert shown == [f"bytes:\\x{byte:02x}" for byte in "🙂".encode()]
