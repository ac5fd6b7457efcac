"""A byte-level BPE tokenizer trained locally, saved as a Hugging Face ``tokenizer.json``.

Text is split into words by a regular expression (letters, digits, punctuation runs and
whitespace runs, a leading space staying with the word after it, as in GPT-2), each word
is mapped to bytes and each byte to one printable character, and learned merges join
adjacent symbols. Every string of valid Unicode scalar values (no lone surrogates, which
UTF-8 cannot encode) round-trips: ``decode(encode(s)) == s``.

The file follows the ``tokenizers`` JSON layout (``model.type = "BPE"``, ``vocab``,
``merges``; a ``Split`` pre-tokenizer with the same pattern followed by ``ByteLevel``;
a ``ByteLevel`` decoder; special tokens in ``added_tokens``), so the Hugging Face
library loads it too. :func:`load_tokenizer` also reads the Qwen2 / Qwen3 files (an NFC
normalizer and their own split pattern, matched the way the Hugging Face library matches
it) and refuses any other setting whose behaviour it does not reproduce.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import json
import operator
import os
import re
import reprlib
import unicodedata
from collections.abc import Container, Iterable, Mapping, Sequence

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
DEFAULT_SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)

# Identifier runs (letters, underscores), digit runs and punctuation runs take one optional
# leading space; every character falls in exactly one class. A whitespace run
# leaves its last space to the word after it, so indentation splits as "\n   " + " def".
WORD_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+"""
_WORD_RE = re.compile(WORD_PATTERN)
# The split pattern of the Qwen2 / Qwen3 tokenizer.json files, in the Oniguruma syntax of the
# Hugging Face library (``\p{L}`` letters, ``\p{N}`` numbers): see _split_regex.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPLIT_PATTERNS = (WORD_PATTERN, QWEN_PATTERN)
NORMALIZERS = (None, "NFC")


def _class_body(keep) -> str:
    """A ``re`` character-class body (``\\U`` ranges) of the code points ``keep(char)`` accepts."""
    ranges, start = [], None
    for c in range(0x110001):
        inside = c < 0x110000 and keep(chr(c))
        if inside and start is None:
            start = c
        elif not inside and start is not None:
            ranges.append(f"\\U{start:08x}-\\U{c - 1:08x}")
            start = None
    return "".join(ranges)


@functools.cache
def _split_regex(pattern: str) -> re.Pattern:
    """``pattern`` (one of SPLIT_PATTERNS) compiled for Python's ``re``.

    ``re`` has no ``\\p{..}`` and its ``\\s`` also takes U+001C..U+001F, which Oniguruma's does
    not: the Qwen pattern gets explicit classes of the Unicode general categories instead.
    """
    if pattern == WORD_PATTERN:
        return _WORD_RE
    letter = _class_body(lambda ch: unicodedata.category(ch).startswith("L"))
    number = _class_body(lambda ch: unicodedata.category(ch).startswith("N"))
    space = "\t\n\x0b\x0c\r\x85" + _class_body(lambda ch: unicodedata.category(ch) in ("Zs", "Zl", "Zp"))
    translated = (
        pattern.replace(r"[^\r\n\p{L}\p{N}]", rf"[^\r\n{letter}{number}]")
        .replace(r"[^\s\p{L}\p{N}]", f"[^{space}{letter}{number}]")
        .replace(r"\p{L}", f"[{letter}]")
        .replace(r"\p{N}", f"[{number}]")
        .replace(r"\S", f"[^{space}]")
        .replace(r"\s", f"[{space}]")
    )
    return re.compile(translated)


def bytes_to_unicode() -> dict[int, str]:
    """Maps each byte to one printable character (printable Latin-1 bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _word_symbols(word: str) -> str:
    return "".join(_BYTE_TO_CHAR[b] for b in word.encode("utf-8"))


def _check_id(field: str, value: object) -> None:
    """Raises unless ``value`` is a token id: a non-negative integer (TypeError, ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field}={value!r} is invalid: token ids must be integers >= 0")
    if value < 0:
        raise ValueError(f"{field}={value!r} is invalid: token ids must be integers >= 0")


def _check_special_tokens(special_tokens: object) -> tuple[str, ...]:
    """``special_tokens`` as a tuple of distinct non-empty strings, or a TypeError / ValueError
    naming ``special_tokens[i]``."""
    if isinstance(special_tokens, (str, bytes)) or not isinstance(special_tokens, Iterable):
        raise TypeError(
            f"special_tokens={special_tokens!r} is invalid: must be a list of str (a bare string would be "
            "split into its characters): wrap it in a list"
        )
    tokens = tuple(special_tokens)
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise TypeError(f"special_tokens[{i}]={token!r} is invalid: must be a str")
        if not token:
            raise ValueError(f"special_tokens[{i}]='' is invalid: must be a non-empty str")
        if token in tokens[:i]:
            raise ValueError(
                f"special_tokens[{i}]={token!r} is invalid: it repeats special_tokens[{tokens.index(token)}] "
                "(each special token must be listed once)"
            )
    return tokens


class Tokenizer:
    """Byte-level BPE: ``encode(str) -> list[int]``, ``decode(ids) -> str``."""

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        special_tokens: Sequence[str],
        *,
        pattern: str = WORD_PATTERN,
        normalizer: str | None = None,
    ):
        """Builds the tokenizer.

        Args:
          vocab: token string (byte characters) → id (an integer >= 0), special tokens included.
          merges: merge rules in priority order, each a pair of tokens of ``vocab`` whose
            concatenation is in ``vocab`` too.
          special_tokens: distinct non-empty strings encoded as one id each wherever they
            appear in text.
          pattern: the regular expression that splits text into words, one of
            ``SPLIT_PATTERNS``: ``WORD_PATTERN`` (what :func:`train_bpe` uses) or
            ``QWEN_PATTERN`` (the Qwen2 / Qwen3 tokenizers').
          normalizer: ``None`` or ``"NFC"`` (Unicode composition of the text outside special
            tokens, before it is split, as the Qwen tokenizers do).

        Raises:
          TypeError: ``vocab`` is not a dict, ``merges`` not a list of pairs, a token or
            special token not a str, or an id not an integer.
          ValueError: an id is negative, two tokens share an id, a special token is empty,
            repeated or not in ``vocab``, ``vocab`` lacks a byte symbol, a merge is not a
            pair of tokens of ``vocab`` whose result is in ``vocab``, or ``pattern`` or
            ``normalizer`` is not one of those above.
        """
        special_tokens = _check_special_tokens(special_tokens)
        if not isinstance(vocab, Mapping):
            raise TypeError(f"vocab={reprlib.repr(vocab)} is invalid: must be a dict mapping each token str to its id")
        if isinstance(merges, (str, bytes)) or not isinstance(merges, Iterable):
            raise TypeError(
                f"merges={reprlib.repr(merges)} is invalid: must be a list of (token, token) pairs in priority order"
            )
        merges = list(merges)
        for j, m in enumerate(merges):
            if not isinstance(m, (tuple, list)):
                raise TypeError(f"merges[{j}]={m!r} is invalid: a merge must be a pair (token, token) of str")
        if pattern not in SPLIT_PATTERNS:
            raise ValueError(
                f"pattern={reprlib.repr(pattern)} is not supported: must be WORD_PATTERN {WORD_PATTERN!r} or "
                f"QWEN_PATTERN {QWEN_PATTERN!r}"
            )
        if normalizer not in NORMALIZERS:
            raise ValueError(f"normalizer={normalizer!r} is not supported: must be None or 'NFC'")
        for token, i in vocab.items():
            if not isinstance(token, str):
                raise TypeError(f"vocab holds the token {token!r}: tokens must be str")
            _check_id(f"vocab[{token!r}]", i)
        missing = [t for t in special_tokens if t not in vocab]
        if missing:
            raise ValueError(f"special_tokens={missing!r} are not in the vocabulary")
        absent = [b for b in range(256) if _BYTE_TO_CHAR[b] not in vocab]
        if absent:
            raise ValueError(
                f"vocab lacks the byte symbols of {len(absent)} bytes (first: {absent[:8]}): a byte-level BPE "
                "vocabulary must hold all 256, or some text cannot be encoded"
            )
        bad = [m for m in merges if len(m) != 2 or not all(isinstance(t, str) for t in m)]
        if bad:
            raise ValueError(f"merges hold {len(bad)} entries that are not pairs of token strings, first: {bad[0]!r}")
        for j, (a, b) in enumerate(merges):
            for what, token in (("part", a), ("part", b), ("result", a + b)):
                if token not in vocab:
                    raise ValueError(
                        f"merges[{j}]={(a, b)!r} is invalid: its {what} {token!r} is not in the vocabulary "
                        "(a merge must join two tokens of vocab into a token of vocab)"
                    )
        self.vocab = dict(vocab)
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        if len(self.id_to_token) != len(self.vocab):
            raise ValueError("vocab maps two tokens to one id")
        self.merges = [tuple(m) for m in merges]
        self.ranks = {m: i for i, m in enumerate(self.merges)}
        self.special_tokens = special_tokens
        self.pattern = pattern
        self.normalizer = normalizer
        self._word_re = _split_regex(pattern)
        self._special_re = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(special_tokens, key=len, reverse=True)) + ")")
            if special_tokens
            else None
        )
        self._cache: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- queries
    @property
    def vocab_size(self) -> int:
        """Number of ids (``max id + 1``), special tokens included."""
        return max(self.id_to_token) + 1

    def token_to_id(self, token: str) -> int:
        """The id of ``token`` (a vocabulary or special token).

        Raises:
          ValueError: ``token`` is not in the vocabulary.
        """
        if token not in self.vocab:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return self.vocab[token]

    @property
    def eos_id(self) -> int:
        """Id of ``<|endoftext|>`` (separates documents)."""
        return self.token_to_id(EOS_TOKEN)

    @property
    def mask_id(self) -> int:
        """Id of ``<|mask|>`` (the draft's mask token)."""
        return self.token_to_id(MASK_TOKEN)

    # ---------------------------------------------------------------- encoding
    def _encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is not None:
            return ids
        symbols = list(_word_symbols(word))
        while len(symbols) > 1:
            pairs = [
                (self.ranks.get((a, b), len(self.ranks)), i) for i, (a, b) in enumerate(itertools.pairwise(symbols))
            ]
            rank, _ = min(pairs)
            if rank == len(self.ranks):
                break
            first, second = self.merges[rank]
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        ids = [self.vocab[s] for s in symbols]
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Text → token ids; special-token strings in the text become their single ids.

        Raises:
          TypeError: ``text`` is not a str.
          ValueError: ``text`` holds a lone surrogate (not a Unicode scalar value: UTF-8, and
            so byte-level BPE, cannot encode it), named with its position and code point.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        pieces = self._special_re.split(text) if self._special_re else [text]
        out: list[int] = []
        try:
            for j, piece in enumerate(pieces):
                if j % 2 == 1:  # a captured special token
                    out.append(self.vocab[piece])
                    continue
                if self.normalizer == "NFC":
                    piece = unicodedata.normalize("NFC", piece)
                for word in self._word_re.findall(piece):
                    out.extend(self._encode_word(word))
        except UnicodeEncodeError:
            at = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
            raise ValueError(
                f"text[{at}] is the lone surrogate U+{ord(text[at]):04X}: text must hold Unicode scalar values "
                "only (UTF-8 cannot encode a surrogate)"
            ) from None
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids → text (invalid UTF-8 from a partial byte sequence becomes U+FFFD)."""
        chunks: list[str] = []
        buf = bytearray()
        for j, i in enumerate(ids):
            try:
                if isinstance(i, bool):
                    raise TypeError
                k = operator.index(i)  # ints, NumPy / jax integer scalars; not floats or strings
            except TypeError:
                raise TypeError(f"ids[{j}]={i!r} is invalid: token ids must be integers") from None
            token = self.id_to_token.get(k)
            if token is None and 0 <= k < self.vocab_size:
                raise ValueError(
                    f"ids[{j}]={k} is an unused id: no token is assigned to it (the vocabulary's ids 0.."
                    f"{self.vocab_size - 1} have gaps)"
                )
            if token is None:
                raise ValueError(f"ids[{j}]={k} is outside the vocabulary (ids 0..{self.vocab_size - 1})")
            if token in self.special_tokens:
                chunks.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                chunks.append(token)
            else:
                buf.extend(_CHAR_TO_BYTE[c] for c in token)
        chunks.append(buf.decode("utf-8", errors="replace"))
        return "".join(chunks)

    # ------------------------------------------------------------------ saving
    def to_json(self) -> dict:
        """The Hugging Face ``tokenizer.json`` structure."""
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {
                    "id": self.vocab[t],
                    "content": t,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
                for t in self.special_tokens
            ],
            "normalizer": {"type": self.normalizer} if self.normalizer else None,
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": self.pattern}, "behavior": "Isolated", "invert": False},
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
                ],
            },
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {t: i for t, i in sorted(self.vocab.items(), key=lambda kv: kv[1])},
                "merges": [f"{a} {b}" for a, b in self.merges],
            },
        }

    def save(self, path: str | os.PathLike) -> str:
        """Writes ``tokenizer.json`` (``path`` is the file or its folder); returns the file path."""
        path = os.fspath(path)
        if not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, ensure_ascii=False)
        return path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Reads a byte-level BPE ``tokenizer.json`` (the file, or a folder holding it).

    Reads what :meth:`Tokenizer.save` writes and the Qwen2 / Qwen3 files; a setting whose
    behaviour :meth:`Tokenizer.encode` or :meth:`Tokenizer.decode` would not reproduce (BPE
    dropout, another normalizer or pre-tokenizer, subword prefixes or suffixes, ...) is
    refused rather than ignored.

    Raises:
      TypeError, ValueError: the file is missing, not UTF-8 JSON, malformed, or holds a setting
        that is not supported, named with the file's path and the field.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer path {path!r} does not exist: expected a tokenizer.json or its folder")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {err.start}: {err.reason}): a tokenizer.json is UTF-8 JSON"
        ) from None
    try:
        return _tokenizer_from_json(data)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{path}: {err}") from None


def _check_setting(field: str, value: object, allowed: tuple, what: str) -> None:
    """Raises ``ValueError`` unless ``value`` is one of ``allowed`` (same type and value: 0 is not False)."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValueError(
            f"{field}={reprlib.repr(value)} is not supported: {what} (allowed: {', '.join(map(repr, allowed))})"
        )


def _check_object(field: str, value: object, what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{field}={reprlib.repr(value)} is not supported: {what}")
    return value


_PRE_TOKENIZER = (
    "the pre-tokenizer must be a Sequence of a Split on WORD_PATTERN (what Tokenizer.save writes) or on "
    "the Qwen2 / Qwen3 pattern, behavior 'Isolated', not inverted, then a ByteLevel without add_prefix_space "
    "or use_regex"
)


def _settings(data: dict, model: dict) -> tuple[str, str | None]:
    """The split pattern and normalizer of a ``tokenizer.json``, or a ValueError naming the first
    setting (field, value, what is allowed) that :class:`Tokenizer` does not reproduce."""
    for field in ("truncation", "padding"):
        _check_setting(field, data.get(field), (None,), "encode neither truncates nor pads")
    normalizer = data.get("normalizer")
    if normalizer is not None:
        normalizer = _check_object("normalizer", normalizer, "must be null or {'type': 'NFC'}")
        _check_setting("normalizer.type", normalizer.get("type"), ("NFC",), "the only normalizer is NFC")
        normalizer = "NFC"
    pre = _check_object("pre_tokenizer", data.get("pre_tokenizer"), _PRE_TOKENIZER)
    _check_setting("pre_tokenizer.type", pre.get("type"), ("Sequence",), _PRE_TOKENIZER)
    steps = pre.get("pretokenizers")
    if not isinstance(steps, list) or len(steps) != 2:
        raise ValueError(f"pre_tokenizer.pretokenizers={reprlib.repr(steps)} is not supported: {_PRE_TOKENIZER}")
    split = _check_object("pre_tokenizer.pretokenizers[0]", steps[0], _PRE_TOKENIZER)
    byte_level = _check_object("pre_tokenizer.pretokenizers[1]", steps[1], _PRE_TOKENIZER)
    for field, value, allowed in (
        ("[0].type", split.get("type"), ("Split",)),
        ("[0].behavior", split.get("behavior"), ("Isolated",)),
        ("[0].invert", split.get("invert"), (False,)),
        ("[1].type", byte_level.get("type"), ("ByteLevel",)),
        ("[1].add_prefix_space", byte_level.get("add_prefix_space"), (False,)),
        ("[1].use_regex", byte_level.get("use_regex"), (False,)),
    ):
        _check_setting("pre_tokenizer.pretokenizers" + field, value, allowed, _PRE_TOKENIZER)
    regex = _check_object("pre_tokenizer.pretokenizers[0].pattern", split.get("pattern"), _PRE_TOKENIZER)
    pattern = regex.get("Regex")
    _check_setting("pre_tokenizer.pretokenizers[0].pattern.Regex", pattern, SPLIT_PATTERNS, _PRE_TOKENIZER)
    post = data.get("post_processor")
    if post is not None:
        post = _check_object("post_processor", post, "must be null or ByteLevel (encode adds no tokens)")
        _check_setting("post_processor.type", post.get("type"), ("ByteLevel",), "encode adds no tokens")
    decoder = _check_object("decoder", data.get("decoder"), "the decoder must be ByteLevel")
    _check_setting("decoder.type", decoder.get("type"), ("ByteLevel",), "the decoder must be ByteLevel")
    _check_setting("model.dropout", model.get("dropout"), (None,), "BPE dropout is not implemented")
    for field in ("continuing_subword_prefix", "end_of_word_suffix"):
        _check_setting(f"model.{field}", model.get(field), (None, ""), "byte-level BPE tokens carry no affixes")
    _check_setting("model.ignore_merges", model.get("ignore_merges", False), (False,), "merges always apply")
    return pattern, normalizer


def _tokenizer_from_json(data: object) -> Tokenizer:
    """The :class:`Tokenizer` of a parsed ``tokenizer.json`` (errors name the field, not the file)."""
    if not isinstance(data, dict):
        raise ValueError(f"the file holds {reprlib.repr(data)}, not a JSON object with 'model' and 'added_tokens'")
    model = data.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"model={reprlib.repr(model)} is invalid: must be an object with type 'BPE', vocab and merges")
    if model.get("type") != "BPE":
        raise ValueError(f"model.type={model.get('type')!r} is not supported: only 'BPE'")
    for field in ("vocab", "merges"):
        if field not in model:
            raise ValueError(f"model.{field} is missing: a BPE tokenizer.json needs model.vocab and model.merges")
    if not isinstance(model["vocab"], dict):
        raise TypeError(
            f"model.vocab={reprlib.repr(model['vocab'])} is invalid: must be an object mapping each token to its id"
        )
    if not isinstance(model["merges"], list):
        raise TypeError(
            f"model.merges={reprlib.repr(model['merges'])} is invalid: must be a list of merges, each 'a b' or "
            "['a', 'b']"
        )
    merges = []
    for j, m in enumerate(model["merges"]):
        if not isinstance(m, (str, list)):
            raise TypeError(f"model.merges[{j}]={m!r} is invalid: a merge must be a string 'a b' or a list ['a', 'b']")
        merges.append(tuple(m.split(" ")) if isinstance(m, str) else tuple(m))
    pattern, normalizer = _settings(data, model)
    vocab = dict(model["vocab"])
    added = data.get("added_tokens", [])
    if not isinstance(added, list):
        raise TypeError(
            f"added_tokens={reprlib.repr(added)} is invalid: must be a list of objects with 'content' and 'id'"
        )
    specials = []
    for j, tok in enumerate(added):
        if not isinstance(tok, dict) or "content" not in tok or "id" not in tok:
            raise ValueError(f"added_tokens[{j}]={tok!r} is invalid: must have 'content' and 'id'")
        if not isinstance(tok["content"], str):
            raise TypeError(f"added_tokens[{j}].content={tok['content']!r} is invalid: must be a str")
        _check_id(f"added_tokens[{j}].id", tok["id"])
        for flag in ("single_word", "lstrip", "rstrip"):
            _check_setting(
                f"added_tokens[{j}].{flag}", tok.get(flag, False), (False,), "added tokens match their exact text"
            )
        vocab[tok["content"]] = tok["id"]
        specials.append(tok["content"])
    return Tokenizer(vocab, merges, specials, pattern=pattern, normalizer=normalizer)


def train_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS
) -> Tokenizer:
    """Learns byte-level BPE merges from ``texts``.

    Pairs are counted over the word-frequency table and updated incrementally after each
    merge; the most frequent pair wins, ties going to the pair of lower ids (deterministic).

    Args:
      texts: training documents.
      vocab_size: total ids wanted: 256 bytes + merges + special tokens. Fewer when the
        text runs out of pairs that occur at least twice.
      special_tokens: appended after the merges, in order: distinct non-empty strings,
        none of them a token the BPE has (a byte symbol or a learned merge), whose id it
        would take over.

    Returns:
      The trained :class:`Tokenizer`.

    Raises:
      TypeError: ``texts`` or ``special_tokens`` is a bare string, or holds a non-str.
      ValueError: ``vocab_size`` is too small, ``texts`` holds no text, or a special token is
        empty, repeated, or a byte symbol or learned token of the BPE.
    """
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"texts must be an iterable of str documents, got a {type(texts).__name__}: wrap it in a list")
    special_tokens = _check_special_tokens(special_tokens)
    _check_specials_are_new(special_tokens, _CHAR_TO_BYTE)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256 + len(special_tokens):
        raise ValueError(
            f"vocab_size={vocab_size!r} is invalid: must be an integer >= 256 + {len(special_tokens)} special tokens"
        )
    words: collections.Counter[str] = collections.Counter()
    for j, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{j}] is a {type(text).__name__}: every document must be a str")
        words.update(_WORD_RE.findall(text))
    if not words:
        raise ValueError("train_bpe got no text: texts is empty or holds only empty strings")

    symbols = [_BYTE_TO_CHAR[b] for b in range(256)]  # id -> token string
    ids = {s: i for i, s in enumerate(symbols)}
    seqs = [[_CHAR_TO_BYTE[c] for c in _word_symbols(w)] for w in words]
    freqs = list(words.values())
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    where: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for w, seq in enumerate(seqs):
        for pair in itertools.pairwise(seq):
            counts[pair] += freqs[w]
            where[pair].add(w)
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while len(symbols) < vocab_size - len(special_tokens) and heap:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -neg:
            continue  # stale entry
        if -neg < 2:
            break
        token = symbols[pair[0]] + symbols[pair[1]]
        # Two merge paths can spell the same string ("ab"+"c", "a"+"bc"): one id for both.
        new_id = ids.get(token, len(symbols))
        if new_id == len(symbols):
            symbols.append(token)
            ids[token] = new_id
        merges.append((symbols[pair[0]], symbols[pair[1]]))
        touched: set[tuple[int, int]] = set()
        for w in where.pop(pair):
            seq = seqs[w]
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == pair[0] and seq[i + 1] == pair[1]:
                    merged.append(new_id)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            if len(merged) == len(seq):
                continue
            for p in itertools.pairwise(seq):
                counts[p] -= freqs[w]
                touched.add(p)
            for p in itertools.pairwise(merged):
                counts[p] += freqs[w]
                where[p].add(w)
                touched.add(p)
            seqs[w] = merged
        counts.pop(pair, None)
        for p in touched:
            c = counts.get(p, 0)
            if c > 0 and p != pair:
                heapq.heappush(heap, (-c, p))
            elif c <= 0:
                counts.pop(p, None)
    _check_specials_are_new(special_tokens, ids)
    vocab = dict(ids)
    for t in special_tokens:
        vocab[t] = len(vocab)
    return Tokenizer(vocab, merges, special_tokens)


def _check_specials_are_new(special_tokens: tuple[str, ...], tokens: Container[str]) -> None:
    """Raises ``ValueError`` naming the first special token that is one of the BPE's ``tokens``:
    its id would be taken over, and text that encodes to it would decode as the special string."""
    for i, token in enumerate(special_tokens):
        if token in tokens:
            raise ValueError(
                f"special_tokens[{i}]={token!r} is invalid: it is already a token of the BPE (a byte symbol or a "
                "learned merge): choose a string no word of the text spells, such as '<|name|>'"
            )
