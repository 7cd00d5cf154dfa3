"""rwkv_jax.nn.TextGenerator: streamed text, UTF-8 across tokens, stop strings, end of text,
sample_below from the tokenizer, batched prompts, errors; the Generator's on_tokens hook; the
World tokenizer's bytes; and examples/generate.py, its front.

A scripted model makes the tokens known in advance: with its blocks' outputs zeroed and one-hot
embeddings, greedy decoding after token ``t`` gives ``t + 1`` (mod the vocabulary), and a fake
tokenizer gives each id the bytes the test needs (characters split across tokens)."""

import dataclasses

import numpy as np
import pytest

import official_rwkv7
from scripts import load_script
from rwkv_jax import nn as rnn

VOCAB = 50
GREEDY = rnn.Sampling(temperature=0)
# From prompt "1" the model spells "a", "é" (2 tokens), "水" (3 tokens), "\n", "\n", "b", "L",
# ...; from "45": "U", "V", "W", "X", then the end of text (token 0).
PIECES = {2: b"a", 3: b"\xc3", 4: b"\xa9", 5: b"\xe6", 6: b"\xb0", 7: b"\xb4", 8: b"\n",
          9: b"\n", 10: b"b"}


class ScriptedTokenizer:
    """Prompts are space-separated ids; id ``i`` is ``PIECES[i]``, else one ASCII letter."""
    end_of_text = 0

    def __init__(self, vocab_size=VOCAB):
        self.vocab_size = vocab_size

    def encode(self, text):
        return [int(word) for word in text.split()]

    def token_bytes(self, token):
        return PIECES.get(token, bytes([ord("A") + token % 26]))


@pytest.fixture(scope="module")
def scripted_model():
    params = official_rwkv7.random_checkpoint(0, vocab_size=VOCAB, n_embd=64, head_size=16)
    for name in params:
        if name.endswith(("att.output.weight", "ffn.value.weight")):
            params[name] = np.zeros_like(params[name])
    params["emb.weight"] = 10 * np.eye(VOCAB, 64, dtype=np.float32)
    head = np.zeros((VOCAB, 64), np.float32)
    head[(np.arange(VOCAB) + 1) % VOCAB, np.arange(VOCAB)] = 1.0  # t -> t + 1
    params["head.weight"] = head
    return rnn.load_rwkv7(params)


@pytest.fixture(scope="module")
def text(scripted_model):
    # One decode step per call: every token reaches the stream on its own.
    return rnn.TextGenerator(scripted_model, tokenizer=ScriptedTokenizer(), max_batch=2,
                             steps_per_call=1)


def _run(text, prompt, **kwargs):
    pieces = []
    result = text.generate(prompt, sampling=GREEDY, on_text=pieces.append, **kwargs)
    assert "".join(pieces) == result.texts[0]
    return pieces, result


def test_streamed_text_is_whole_characters_and_adds_up_to_the_text(text):
    pieces, result = _run(text, "1", max_new_tokens=9)
    assert pieces == ["a", "é", "水", "\n", "\n", "b"]
    assert result.texts == ["aé水\n\nb"] and result.finish == ["length"]
    assert result.generation.tokens == [list(range(2, 11))]
    # A character cut short by the length limit ends as a replacement character.
    pieces, result = _run(text, "4", max_new_tokens=1)
    assert pieces == ["\ufffd"] and result.texts == ["\ufffd"]


def test_stop_strings_end_the_text_and_are_never_streamed(text):
    pieces, result = _run(text, "1", max_new_tokens=30, stop=["\n\n", "zz"])
    assert result.texts == ["aé水"] and result.finish == ["stop"]
    assert not any("\n" in piece for piece in pieces)
    # The lane stopped at the stop string, not at max_new_tokens.
    assert result.generation.tokens == [list(range(2, 10))]
    # Across four tokens and two characters.
    pieces, result = _run(text, "1", max_new_tokens=30, stop="é水")
    assert pieces == ["a"] and result.texts == ["a"] and result.finish == ["stop"]
    # A tail that begins a stop string waits until it cannot be one ("水", "水\n" could begin
    # "水\nZ"), or until the end ("\nb" could begin "\nbZ").
    pieces, result = _run(text, "1", max_new_tokens=9, stop=["水\nZ"])
    assert pieces == ["a", "é", "水\n\n", "b"] and result.finish == ["length"]
    pieces, result = _run(text, "1", max_new_tokens=9, stop=["\nbZ"])
    assert pieces == ["a", "é", "水", "\n", "\nb"] and result.texts == ["aé水\n\nb"]


def test_end_of_text_ends_the_text(text):
    pieces, result = _run(text, "45", max_new_tokens=30)
    assert pieces == ["U", "V", "W", "X"] and result.finish == ["end"]
    assert result.generation.tokens == [[46, 47, 48, 49]]


def test_batched_prompts_stream_to_their_own_callbacks(text, scripted_model):
    # Four prompts through two lanes, five tokens per call: a call's tokens run past the stop
    # strings and characters span calls.
    batched = rnn.TextGenerator(scripted_model, tokenizer=ScriptedTokenizer(), max_batch=2,
                                steps_per_call=5)
    prompts = ["1", "45", "4", "1"]
    pieces = [[], [], [], []]
    callbacks = [pieces[0].append, pieces[1].append, None, pieces[3].append]
    result = batched.generate(prompts, max_new_tokens=12, sampling=GREEDY, stop="\n\n",
                              on_text=callbacks)
    assert result.texts == ["aé水", "UVWX", "水", "aé水"]
    assert result.finish == ["stop", "end", "stop", "stop"]
    assert ["".join(p) for p in pieces] == ["aé水", "UVWX", "", "aé水"]
    assert not any("\ufffd" in piece for p in pieces for piece in p)
    for prompt, got in zip(prompts, result.texts):  # the same as each prompt alone
        assert text.generate(prompt, max_new_tokens=12, sampling=GREEDY, stop="\n\n").texts == [got]


def test_sample_below_follows_the_tokenizer(scripted_model):
    # The tokenizer knows 20 ids of the model's 50: greedy decoding from 15 would reach 20.
    small = rnn.TextGenerator(scripted_model, tokenizer=ScriptedTokenizer(20), max_batch=2,
                              steps_per_call=1)
    assert small.generator.sample_below == 20
    result = small.generate("15", max_new_tokens=12, sampling=GREEDY)
    tokens = result.generation.tokens[0]
    assert tokens[:4] == [16, 17, 18, 19] and len(tokens) > 4 and max(tokens) < 20
    same = rnn.TextGenerator(scripted_model, tokenizer=ScriptedTokenizer(VOCAB))
    assert same.generator.sample_below is None


def test_text_generator_errors_name_the_argument(text, scripted_model, monkeypatch):
    cases = [
        (dict(prompts=[]), ValueError, "prompts must hold at least one prompt"),
        (dict(prompts=[1]), TypeError, r"prompts\[0\] must be a str, got int 1"),
        (dict(prompts=b"1"), TypeError, "prompts must be a str or a list of str, got bytes"),
        (dict(prompts=["1", ""]), ValueError, r"prompts\[1\] must not be empty"),
        (dict(stop=""), ValueError, r"stop\[0\] must not be empty"),
        (dict(stop=[None]), TypeError, r"stop\[0\] must be a str"),
        (dict(on_text=print, prompts=["1", "2"]), TypeError,
         r"on_text must be one callable \(or None\) per prompt.*\(2 here\)"),
        (dict(on_text=[print]), TypeError, r"on_text must be one callable"),
        (dict(on_text="print"), TypeError, r"on_text must be one callable"),
    ]
    for change, error, message in cases:
        kwargs = {"prompts": "1", "max_new_tokens": 2, **change}
        with pytest.raises(error, match=message):
            text.generate(kwargs.pop("prompts"), **kwargs)
    with pytest.raises(TypeError, match="sample_below is set from the tokenizer"):
        rnn.TextGenerator(scripted_model, tokenizer=ScriptedTokenizer(), sample_below=3)
    monkeypatch.setitem(__import__("sys").modules, "pyrwkv_tokenizer", None)
    with pytest.raises(ImportError, match=r'needs pyrwkv-tokenizer: pip install "rwkv_jax\['
                                          r'tokenizer\]"'):
        rnn.TextGenerator(scripted_model)


def test_world_tokenizer_gives_each_token_its_bytes():
    tokenizer = rnn.WorldTokenizer()
    assert tokenizer.vocab_size == 65530 and tokenizer.end_of_text == 0
    ids = tokenizer.encode("é水 ok\n\n")
    assert b"".join(map(tokenizer.token_bytes, ids)).decode() == "é水 ok\n\n"
    # Ids 129 to 256 are the single bytes 0x80 to 0xff: parts of characters, which the
    # tokenizer's own decode cannot give alone.
    assert [tokenizer.token_bytes(t) for t in (231, 177, 181)] == [b"\xe6", b"\xb0", b"\xb4"]
    assert tokenizer.token_bytes(65529) == b" " * 128
    with pytest.raises(ValueError, match="token 0 has no text"):
        tokenizer.token_bytes(0)


def test_on_tokens_sees_each_call_and_can_end_a_request(scripted_model):
    engine = rnn.Generator(scripted_model, max_batch=2, steps_per_call=2)
    seen = {0: [], 1: [], 2: []}

    def on_tokens(i, tokens, finished):
        seen[i].append((tokens, finished))
        return 5 in tokens  # ends request 0 ([2, 3], [4, 5]), not request 1

    result = engine.generate([[1], [20], [30]], max_new_tokens=5, sampling=GREEDY,
                             on_tokens=on_tokens)
    assert result.tokens == [[2, 3, 4, 5], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]]
    assert result.finish == ["stop", "length", "length"]
    assert seen[0] == [([2, 3], False), ([4, 5], False)]
    assert [t for tokens, _ in seen[1] for t in tokens] == [21, 22, 23, 24, 25]
    assert [done for _, done in seen[1]] == [False] * (len(seen[1]) - 1) + [True]
    with pytest.raises(TypeError, match="on_tokens must be callable or None, got int"):
        engine.generate([[1]], max_new_tokens=1, on_tokens=1)


def test_generate_example_streams_text_from_a_random_checkpoint(tmp_path, capsys):
    example = load_script("examples/generate.py")
    path = tmp_path / "random.npz"
    result = example.main(["--random-checkpoint", str(path), "--prompt", "Hi", "--max-new-tokens",
                           "6", "--steps-per-call", "2"])
    out = capsys.readouterr().out
    assert result["sample_below"] == 65530  # the head has 65,536 outputs
    assert all(len(t) <= 6 and max(t, default=0) < 65530 for t in result["tokens"])
    assert "\nHi" + result["texts"][0] + "\n\nfinish: " in out  # streamed, all of it
    # "Hi" is one token: nothing to prefill, said so.
    assert "prefill: none (each prompt's last token goes with the first decode step)" in out
    assert "decode: " in out and "tokens/s" in out
    # The checkpoint written by the first run loads on the next: two prompts through its one
    # lane (the programs compiled for the first run serve it), a stop string.
    again = example.main(["--checkpoint", str(path), "--prompt", "The capital of France is",
                          "--prompt", "Hi", "--max-new-tokens", "3", "--steps-per-call", "2",
                          "--batch-size", "1", "--stop", "\n"])
    out = capsys.readouterr().out
    assert len(again["texts"]) == 2 and "[0] The capital of France is\n[1] Hi" in out
    assert "prefill: 4 tokens in" in out


def test_generate_example_says_what_is_wrong_before_anything_else(tmp_path, capsys):
    example = load_script("examples/generate.py")
    missing = tmp_path / "rwkv7-g1-0.1b.pth"
    with pytest.raises(SystemExit) as exit_:
        example.main(["--checkpoint", str(missing), "--prompt", "Hi"])
    assert exit_.value.code == 2
    assert f"--checkpoint {missing}: no such file" in capsys.readouterr().err
    # --help shows every default; the sampling ones are Sampling's.
    with pytest.raises(SystemExit):
        example.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split()).split("options:")[1]
    for field in dataclasses.fields(rnn.Sampling):
        flag = "--" + field.name.replace("_", "-")
        assert f"(default: {field.default})" in help_text.split(f"{flag} {field.name.upper()}")[1]
    assert "(default: 64)" in help_text and "(default: 32)" in help_text
