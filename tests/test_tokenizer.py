"""The byte-level BPE tokenizer: round trips, merges, the tokenizer.json file."""

import collections
import itertools
import json

import jax
import numpy as np
import pytest

from dspark_jax.tokenizer import (
    EOS_TOKEN,
    MASK_TOKEN,
    QWEN_PATTERN,
    WORD_PATTERN,
    Tokenizer,
    bytes_to_unicode,
    load_tokenizer,
    train_bpe,
)

TEXTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):\n        self.x = x\n',
    "for i in range(10):\n    print(i, i * i)  # squares\n" * 3,
]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(TEXTS, 300)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain ascii text",
        "    indented\n\tand tabbed\r\n",
        "unicode: héllo wörld 日本語 ✓ 🙂 x² ½",
        "control \x00\x01\x7f bytes",
        f"special {EOS_TOKEN} tokens {MASK_TOKEN}{MASK_TOKEN} inside",
        "unseen words: zyxwvut qqqq 12345678901234567890",
    ],
)
def test_decode_inverts_encode(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_every_character_class_is_covered_by_the_word_pattern():
    import re

    text = "a_b1 2.3 !!  \n\t x__y ü ² 日"
    assert "".join(re.findall(WORD_PATTERN, text)) == text


def test_special_tokens_encode_to_single_ids(tok):
    ids = tok.encode(f"x{MASK_TOKEN}y{EOS_TOKEN}")
    assert tok.mask_id in ids and tok.eos_id in ids
    assert tok.mask_id != tok.eos_id
    assert tok.vocab_size == 300
    assert {tok.mask_id, tok.eos_id} == {298, 299}


def test_first_merge_is_the_most_frequent_adjacent_byte_pair():
    import re

    counts = collections.Counter()
    byte_char = bytes_to_unicode()
    for text in TEXTS:
        for word in re.findall(WORD_PATTERN, text):
            symbols = [byte_char[b] for b in word.encode()]
            counts.update(zip(symbols[:-1], symbols[1:], strict=True))
    best = max(counts.values())
    tok = train_bpe(TEXTS, 260)
    assert counts[tok.merges[0]] == best


def test_merges_shorten_the_encoding(tok):
    text = TEXTS[0]
    assert len(tok.encode(text)) < 0.7 * len(text.encode())


def test_training_is_deterministic():
    a, b = train_bpe(TEXTS, 280), train_bpe(list(TEXTS), 280)
    assert a.merges == b.merges and a.vocab == b.vocab


def test_saved_file_is_a_hugging_face_bpe_and_loads_back(tok, tmp_path):
    path = tok.save(tmp_path)
    with open(path) as f:
        data = json.load(f)
    assert data["model"]["type"] == "BPE"
    assert all(isinstance(m, str) and len(m.split(" ")) == 2 for m in data["model"]["merges"])
    assert data["pre_tokenizer"]["pretokenizers"][1]["type"] == "ByteLevel"
    assert data["decoder"]["type"] == "ByteLevel"
    assert {t["content"] for t in data["added_tokens"]} == {EOS_TOKEN, MASK_TOKEN}
    again = load_tokenizer(tmp_path)
    text = TEXTS[1] + MASK_TOKEN + "ünïcode"
    assert again.encode(text) == tok.encode(text)
    assert again.vocab_size == tok.vocab_size


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(TEXTS, 100)
    with pytest.raises(ValueError, match="no text"):
        train_bpe(["", ""], 300)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(TypeError, match="str"):
        train_bpe(TEXTS, 260).encode(b"bytes")


def test_decode_refuses_non_integer_ids_by_position(tok):
    """Floats and strings used to be truncated or parsed (``int(i)``); integer scalars of
    NumPy and jax still decode."""
    ids = tok.encode("the cat")
    assert tok.decode(np.asarray(ids, np.int32)) == tok.decode(list(jax.numpy.asarray(ids))) == "the cat"
    for bad in (100.7, "5", True):
        with pytest.raises(TypeError, match=rf"ids\[1\]={bad!r} is invalid: token ids must be integers"):
            tok.decode([ids[0], bad])
    with pytest.raises(ValueError, match=rf"ids\[0\]={tok.vocab_size} is outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_training_refuses_a_bare_string_and_non_string_documents():
    with pytest.raises(TypeError, match="texts must be an iterable of str documents, got a str"):
        train_bpe("the cat sat on the mat", 300)
    with pytest.raises(TypeError, match=r"texts\[1\] is a int: every document must be a str"):
        train_bpe(["the cat", 5], 300)


def test_encoding_documents_refuses_a_bare_string_and_non_string_documents(tok):
    from dspark_jax.corpus import encode_documents

    with pytest.raises(TypeError, match="texts must be an iterable of str documents, got a str: wrap it in a list"):
        encode_documents(tok, "abc")
    with pytest.raises(TypeError, match=r"texts\[1\] is a bytes: every document must be a str"):
        encode_documents(tok, ["the cat", b"sat"])
    ids = encode_documents(tok, (t for t in ["ab", "cd"]))  # any iterable of documents
    assert ids.tolist() == [*tok.encode("ab"), tok.eos_id, *tok.encode("cd"), tok.eos_id]


def test_malformed_tokenizer_files_are_refused_with_their_path(tok, tmp_path):
    good = tok.to_json()
    cases = {
        "not_json": "{",
        "no_merges": {**good, "model": {k: v for k, v in good["model"].items() if k != "merges"}},
        "triple_merge": {**good, "model": {**good["model"], "merges": ["a b c", *good["model"]["merges"]]}},
        "no_bytes": {**good, "model": {**good["model"], "vocab": {"a": 0}, "merges": []}, "added_tokens": []},
        "bad_added": {**good, "added_tokens": [{"content": "<x>"}]},
    }
    says = {
        "not_json": "is not valid JSON",
        "no_merges": "model.merges is missing",
        "triple_merge": "not pairs of token strings, first: \\('a', 'b', 'c'\\)",
        "no_bytes": "vocab lacks the byte symbols of 255 bytes",
        "bad_added": r"added_tokens\[0\]=.* must have 'content' and 'id'",
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        with pytest.raises(ValueError, match=says[name]) as err:
            load_tokenizer(path)
        assert str(path) in str(err.value), err.value


def _edited(tok, tmp_path, edit):
    """``tok``'s tokenizer.json after ``edit(data)``, saved under ``tmp_path``."""
    data = tok.to_json()
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (
            lambda d: d["model"]["vocab"].update(h=-5),
            ValueError,
            r"vocab\['h'\]=-5 is invalid: token ids must be integers >= 0",
        ),
        (
            lambda d: d["model"]["vocab"].update(h=1.5),
            TypeError,
            r"vocab\['h'\]=1.5 is invalid: token ids must be integers",
        ),
        (lambda d: d["model"]["vocab"].update(h="104"), TypeError, r"vocab\['h'\]='104' is invalid: token ids must be"),
        (
            lambda d: d["added_tokens"][0].update(id=-1),
            ValueError,
            r"added_tokens\[0\].id=-1 is invalid: token ids must",
        ),
        (
            lambda d: d["added_tokens"].append({"id": 600, "content": 7}),
            TypeError,
            r"added_tokens\[2\].content=7 is invalid: must be a str",
        ),
        (
            lambda d: d["model"]["merges"].insert(0, "zz qq"),
            ValueError,
            r"merges\[0\]=\('zz', 'qq'\) is invalid: its part 'zz' is not in the vocabulary",
        ),
    ],
    ids=[
        "negative-id",
        "float-id",
        "string-id",
        "negative-added-id",
        "added-content-not-str",
        "merge-of-unknown-tokens",
    ],
)
def test_tokenizer_files_with_bad_ids_merges_or_added_tokens_are_refused(tok, tmp_path, edit, error, message):
    path = _edited(tok, tmp_path, edit)
    with pytest.raises(error, match=message) as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


def test_a_merge_whose_result_is_not_in_the_vocabulary_is_refused_when_loading(tok, tmp_path):
    first, second = tok.merges[0]
    path = _edited(tok, tmp_path, lambda d: d["model"]["vocab"].pop(first + second))
    with pytest.raises(
        ValueError, match=rf"merges\[0\]=.* is invalid: its result '{first + second}' is not in the vocab"
    ):
        load_tokenizer(path)


@pytest.mark.parametrize(
    ("specials", "error", "message"),
    [
        ([EOS_TOKEN, ""], ValueError, r"special_tokens\[1\]='' is invalid: must be a non-empty str"),
        (
            [EOS_TOKEN, MASK_TOKEN, EOS_TOKEN],
            ValueError,
            r"special_tokens\[2\]='<\|endoftext\|>' is invalid: it repeats special_tokens\[0\]",
        ),
        ([EOS_TOKEN, 5], TypeError, r"special_tokens\[1\]=5 is invalid: must be a str"),
        (EOS_TOKEN, TypeError, r"special_tokens='<\|endoftext\|>' is invalid: must be a list of str"),
        ([EOS_TOKEN, "h"], ValueError, r"special_tokens\[1\]='h' is invalid: it is already a token of the BPE"),
        (
            [MASK_TOKEN, "Ġrange"],
            ValueError,
            r"special_tokens\[1\]='Ġrange' is invalid: it is already a token of the BPE",
        ),
    ],
    ids=["empty", "repeated", "not-str", "bare-str", "byte-symbol", "learned-merge"],
)
def test_training_refuses_special_tokens_that_would_break_the_round_trip(specials, error, message):
    """An empty special token split every word; one the BPE has (a byte, or a merge such as
    ' range' = 'Ġrange') took its id over, so encoding the text decoded as the special string."""
    with pytest.raises(error, match=message):
        train_bpe(TEXTS, 300, special_tokens=specials)


def test_encoding_a_lone_surrogate_names_its_position_and_code_point(tok):
    with pytest.raises(ValueError, match=r"text\[3\] is the lone surrogate U\+D800: text must hold Unicode scalar"):
        tok.encode("ab \ud800 c")
    assert tok.decode(tok.encode("ab \U0001f642 c")) == "ab \U0001f642 c"  # a surrogate pair's character is fine


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["model"].update(dropout=0.5), "model.dropout=0.5"),
        (lambda d: d["model"].update(continuing_subword_prefix="##"), "model.continuing_subword_prefix='##'"),
        (lambda d: d["model"].update(end_of_word_suffix="</w>"), "model.end_of_word_suffix='</w>'"),
        (lambda d: d["model"].update(ignore_merges=True), "model.ignore_merges=True"),
        (lambda d: d.update(normalizer={"type": "NFKC"}), "normalizer.type='NFKC'"),
        (lambda d: d.update(normalizer="NFC"), "normalizer='NFC'"),
        (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer.type='Whitespace'"),
        (lambda d: d.update(pre_tokenizer=None), "pre_tokenizer=None"),
        (
            lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\w+|\W+"),
            r"pre_tokenizer.pretokenizers[0].pattern.Regex='\\w+|\\W+'",
        ),
        (
            lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"),
            "pre_tokenizer.pretokenizers[0].behavior='Removed'",
        ),
        (
            lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
            "pre_tokenizer.pretokenizers[1].add_prefix_space=True",
        ),
        (lambda d: d["pre_tokenizer"]["pretokenizers"].pop(0), "pre_tokenizer.pretokenizers=[{"),
        (lambda d: d.update(post_processor={"type": "TemplateProcessing"}), "post_processor.type='TemplateProcessing'"),
        (lambda d: d.update(decoder=None), "decoder=None"),
        (lambda d: d.update(truncation={"max_length": 8}), "truncation={'max_length': 8}"),
        (lambda d: d["added_tokens"][0].update(lstrip=True), "added_tokens[0].lstrip=True"),
    ],
    ids=[
        "dropout",
        "subword-prefix",
        "word-suffix",
        "ignore-merges",
        "nfkc",
        "normalizer-not-object",
        "whitespace-pre-tokenizer",
        "no-pre-tokenizer",
        "other-split-regex",
        "split-removed",
        "prefix-space",
        "no-split",
        "template-post-processor",
        "no-decoder",
        "truncation",
        "added-lstrip",
    ],
)
def test_tokenizer_files_with_settings_encode_does_not_reproduce_are_refused(tok, tmp_path, edit, field):
    """These used to load with the setting ignored, so encode differed from Hugging Face's."""
    path = _edited(tok, tmp_path, edit)
    with pytest.raises(ValueError, match="is not supported") as err:
        load_tokenizer(path)
    assert str(path) in str(err.value) and field in str(err.value), err.value


def test_qwen_tokenizer_files_load_and_split_like_hugging_face(tmp_path):
    """A Qwen2 / Qwen3 file (NFC, their split pattern, '' affixes, merges as lists) loads and
    splits as the ``tokenizers`` library does (checked against it: digits one by one,
    case-insensitive contractions, U+001C not whitespace, composed accents)."""
    char = bytes_to_unicode()
    merges = [("'", "S"), ("1", "2"), ("Ã", "©"), (char[0x1C], char[0x1C])]
    vocab = {c: b for b, c in char.items()}
    vocab.update({a + b: 256 + j for j, (a, b) in enumerate(merges)})
    vocab[EOS_TOKEN] = len(vocab)
    data = Tokenizer(vocab, merges, [EOS_TOKEN], pattern=QWEN_PATTERN, normalizer="NFC").to_json()
    assert data["normalizer"] == {"type": "NFC"}
    assert data["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {"Regex": QWEN_PATTERN}
    data["model"].update(continuing_subword_prefix="", end_of_word_suffix="", merges=[list(m) for m in merges])
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    qwen = load_tokenizer(path)
    text = "x'S 123 e\u0301a\x1c\x1cb"  # NFC: e + U+0301 -> é
    words = ["x", "'S", "Ġ", "1", "2", "3", "Ġ", "Ã©", "a", char[0x1C] * 2, "b"]
    assert qwen.encode(text) == [vocab[w] for w in words]
    assert qwen.decode(qwen.encode(text)) == "x'S 123 éa\x1c\x1cb"
    assert load_tokenizer(qwen.save(tmp_path / "again")).encode(text) == qwen.encode(text)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda d: d.update(model=[]), ValueError, r"model=\[\] is invalid: must be an object"),
        (lambda d: d["model"].update(vocab=[1, 2]), TypeError, r"model.vocab=\[1, 2\] is invalid: must be an object"),
        (lambda d: d["model"].update(vocab=None), TypeError, r"model.vocab=None is invalid"),
        (lambda d: d["model"].update(merges=[5]), TypeError, r"model.merges\[0\]=5 is invalid: a merge must be"),
        (lambda d: d["model"].update(merges=None), TypeError, r"model.merges=None is invalid: must be a list"),
        (lambda d: d.update(added_tokens=None), TypeError, r"added_tokens=None is invalid: must be a list"),
    ],
    ids=["model-list", "vocab-list", "vocab-null", "merge-int", "merges-null", "added-tokens-null"],
)
def test_malformed_tokenizer_files_name_the_path_and_field(tok, tmp_path, edit, error, message):
    """These used to raise bare AttributeErrors / TypeErrors naming neither."""
    path = _edited(tok, tmp_path, edit)
    with pytest.raises(error, match=message) as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


def test_a_tokenizer_file_that_is_not_utf8_is_refused_with_its_path(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="is not UTF-8 text") as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (([], [], []), TypeError, r"vocab=\[\] is invalid: must be a dict"),
        ((None, [], []), TypeError, r"vocab=None is invalid: must be a dict"),
        (("vocab", None), TypeError, r"merges=None is invalid: must be a list of \(token, token\) pairs"),
        (("vocab", [5]), TypeError, r"merges\[0\]=5 is invalid: a merge must be a pair"),
        (("vocab", ["ab"]), TypeError, r"merges\[0\]='ab' is invalid: a merge must be a pair"),
    ],
    ids=["vocab-list", "vocab-none", "merges-none", "merge-int", "merge-str"],
)
def test_tokenizer_arguments_of_the_wrong_type_are_named(tok, args, error, message):
    if args[0] == "vocab":
        args = (dict(tok.vocab), args[1], list(tok.special_tokens))
    with pytest.raises(error, match=message):
        Tokenizer(*args)


def test_decode_names_an_id_inside_the_range_that_no_token_has(tok):
    vocab = {**tok.vocab, "zzz": 5000}
    gappy = Tokenizer(vocab, tok.merges, list(tok.special_tokens))
    with pytest.raises(ValueError, match=r"ids\[0\]=4000 is an unused id: no token is assigned to it"):
        gappy.decode([4000])
    with pytest.raises(ValueError, match=r"ids\[0\]=5001 is outside the vocabulary \(ids 0..5000\)"):
        gappy.decode([5001])


def _gpt2_bytes_to_unicode():
    """GPT-2's table, written out: the printable bytes '!'..'~', '¡'..'¬' and '®'..'ÿ' map to
    themselves; every other byte, in byte order, to the next character from U+0100 upward."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + j) for j, b in enumerate(others)}}


def test_byte_table_is_gpt2s():
    table = bytes_to_unicode()
    assert table == _gpt2_bytes_to_unicode()
    assert table[0x20] == "Ġ" and table[0x0A] == "Ċ" and table[0xAD] == "Ń" and table[0xAC] == "¬"
    assert len(set(table.values())) == 256


def _byte_vocab(specials=()):
    """Every byte symbol and then ``specials``, numbered in order (no merges)."""
    vocab = {c: b for b, c in bytes_to_unicode().items()}
    vocab.update({t: len(vocab) + j for j, t in enumerate(specials)})
    return vocab


@pytest.mark.parametrize("specials", [["<|a|>", "<|a|>x"], ["<|a|>x", "<|a|>"]])
def test_the_longest_special_token_matches_first_whatever_their_order(specials):
    tok = Tokenizer(_byte_vocab(specials), [], specials)
    long, short = tok.vocab["<|a|>x"], tok.vocab["<|a|>"]
    assert tok.encode("<|a|>x") == [long]
    assert tok.encode("<|a|>y<|a|>x<|a|>") == [short, tok.vocab["y"], long, short]
    assert tok.decode(tok.encode("<|a|>x<|a|>")) == "<|a|>x<|a|>"


def test_merges_are_learned_only_for_pairs_that_occur_at_least_twice():
    single = train_bpe(["ab cd"], 400)
    assert single.merges == [] and single.vocab_size == 256 + 2  # every pair occurs once
    assert train_bpe(["ab ab"], 400).merges[0] == ("a", "b")  # "ab" twice, " a" once
    import re

    byte_char = bytes_to_unicode()
    words = collections.Counter(w for text in TEXTS for w in re.findall(WORD_PATTERN, text))
    seqs = {w: [byte_char[b] for b in w.encode()] for w in words}
    tok = train_bpe(TEXTS, 2000)  # more ids than the text's repeated pairs can fill
    assert len(tok.merges) > 0 and tok.vocab_size < 2000
    for a, b in tok.merges:  # recount each pair, as the merges before it left the words
        count = sum(n for w, n in words.items() for pair in itertools.pairwise(seqs[w]) if pair == (a, b))
        assert count >= 2, (a, b, count)
        for w, seq in seqs.items():
            merged, i = [], 0
            while i < len(seq):
                if seq[i : i + 2] == [a, b]:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            seqs[w] = merged


def _qwen_bytes_tokenizer():
    """A Qwen-pattern, NFC tokenizer of the byte symbols alone."""
    return Tokenizer(_byte_vocab([EOS_TOKEN]), [], [EOS_TOKEN], pattern=QWEN_PATTERN, normalizer="NFC")


def test_nfc_composes_accents_but_keeps_compatibility_characters():
    """NFC composes "e" + U+0301 into "é" but, unlike NFKC, keeps the ligature "ﬁ", the circled
    digit "①" and the fullwidth "ｘ" (NFKC would give "fi", "1" and "x")."""
    tok = _qwen_bytes_tokenizer()
    text = "ﬁ ① ｘ"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text) == [tok.vocab[c] for c in "".join(bytes_to_unicode()[b] for b in text.encode())]
    assert tok.encode("e\u0301") == tok.encode("é") and tok.decode(tok.encode("e\u0301")) == "é"


@pytest.mark.parametrize(
    ("text", "words"),
    [("a \x85b", ["a", " ", "\x85b"]), ("!\x85a", ["!", "\x85a"])],
)
def test_qwen_split_counts_next_line_as_whitespace(text, words):
    """U+0085 (NEL) is in Oniguruma's ``\\s``, which the Hugging Face library matches the Qwen
    pattern with (these are its splits). So in "a \\x85b" the space cannot start the
    punctuation branch `` ?[^\\s\\p{L}\\p{N}]+`` (NEL is whitespace), ``\\s+(?!\\S)`` takes the
    space alone, and NEL then prefixes the letters (``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+``); in
    "!\\x85a" the punctuation run stops before NEL."""
    from dspark_jax.tokenizer import _split_regex

    assert _split_regex(QWEN_PATTERN).findall(text) == words
