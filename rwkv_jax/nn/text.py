"""Text in, text out: :class:`TextGenerator` owns a tokenizer (by default the RWKV "World"
tokenizer, :class:`WorldTokenizer`) and a :class:`~rwkv_jax.nn.Generator`, and streams each
prompt's continuation as it completes.

Text comes from the tokens' bytes through an incremental UTF-8 decoder, so a character whose
bytes span several tokens comes out whole once its last byte is there; a stop string ends a
prompt's text (the text stops before it), and the stream holds back any tail that could still
grow into a stop string, so that nothing it sends turns out later to belong to one.
"""

from __future__ import annotations

import ast
import codecs
from typing import Callable, NamedTuple, Sequence

from .generate import Generation, Generator, Sampling


class WorldTokenizer:
    """The RWKV "World" tokenizer (the vocabulary of the released RWKV-7 models): the
    ``pyrwkv-tokenizer`` package's encoder, and each id's bytes read from its vocabulary file
    (its own ``decode`` fails on ids that end inside a character). Ids run from 1 to
    ``vocab_size - 1``; 0 is the end of text."""

    end_of_text = 0

    def __init__(self, vocab_file: str | None = None):
        try:
            import pyrwkv_tokenizer
        except ModuleNotFoundError as err:
            if err.name != "pyrwkv_tokenizer":
                raise
            raise ImportError('the RWKV World tokenizer needs pyrwkv-tokenizer: pip install '
                              '"rwkv_jax[tokenizer]" (or pip install pyrwkv-tokenizer)') from err
        self._tokenizer = pyrwkv_tokenizer.RWKVTokenizer(vocab_filepath=vocab_file)
        self._bytes = _vocabulary_bytes(self._tokenizer.vocab_filepath)
        self.vocab_size = self._tokenizer.vocab_size()

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def token_bytes(self, token: int) -> bytes:
        piece = self._bytes.get(token)
        if piece is None:
            raise ValueError(f"token {token} has no text in the World vocabulary (ids 1 to "
                             f"{self.vocab_size - 1})")
        return piece


def _vocabulary_bytes(path) -> dict[int, bytes]:
    """Token id -> its bytes. Each line of the World vocabulary file is ``id literal length``,
    the literal a Python str (its UTF-8) or bytes."""
    table = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            token_id, rest = line.split(" ", 1)
            literal = ast.literal_eval(rest[:rest.rindex(" ")])
            table[int(token_id)] = literal.encode() if isinstance(literal, str) else literal
    return table


class TextGeneration(NamedTuple):
    """``texts[i]``: prompt ``i``'s continuation (without the stop string); ``finish[i]``:
    "end" (the end-of-text token), "stop" (a stop string) or "length" (``max_new_tokens``);
    ``generation``: the engine's :class:`Generation` (the sampled tokens, which may run past a
    stop string to the end of that decode call, and the prefill and decode counts and times)."""
    texts: list[str]
    finish: list[str]
    generation: Generation


class _TextStream:
    """One prompt's text as its tokens arrive."""

    def __init__(self, token_bytes, stops, on_text):
        self.token_bytes, self.stops, self.on_text = token_bytes, stops, on_text
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far, cut before a stop string once one is seen
        self.sent = 0  # how much of it went to on_text
        self.stopped = False

    def push(self, tokens, finished: bool) -> bool:
        """Take a decode call's tokens; returns whether a stop string ended the text."""
        pieces = [self.decoder.decode(self.token_bytes(t)) for t in tokens]
        if finished:  # a character cut short comes out as a replacement character
            pieces.append(self.decoder.decode(b"", final=True))
        for piece in pieces:
            if self._extend(piece):
                break
        self._send(len(self.text) if finished or self.stopped else len(self.text) - self._held())
        return self.stopped

    def _extend(self, piece: str) -> bool:
        """Append ``piece``; cut the text before the first stop string it completes. Only an
        occurrence that ends in ``piece`` can be new (the text before held none)."""
        end = len(self.text)
        self.text += piece
        starts = [found for stop in self.stops
                  if (found := self.text.find(stop, max(0, end - len(stop) + 1))) >= 0]
        if starts:
            self.text, self.stopped = self.text[:min(starts)], True
        return self.stopped

    def _held(self) -> int:
        """The length of the longest unsent tail that begins some stop string."""
        unsent = len(self.text) - self.sent
        return max((k for stop in self.stops for k in range(1, min(len(stop), unsent + 1))
                    if self.text.endswith(stop[:k])), default=0)

    def _send(self, end: int):
        if end > self.sent:
            if self.on_text is not None:
                self.on_text(self.text[self.sent:end])
            self.sent = end


def _strings(name, values) -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a str or a list of str, got {type(values).__name__}")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(value).__name__} {value!r}")
        if not value:
            raise ValueError(f"{name}[{i}] must not be empty")
    return list(values)


class TextGenerator:
    """Text prompts in, text out, streamed: a tokenizer and a :class:`Generator` of ``model``
    (any model the Generator serves) built with ``engine`` (its keywords: ``max_batch``,
    ``steps_per_call``, ``backend``, ...) and ``sample_below`` set from the tokenizer, so that
    only ids it knows are sampled (the World tokenizer knows 65,530; the released models' head
    has 65,536 outputs).

    ``tokenizer``: by default a :class:`WorldTokenizer`; any object with ``encode(text) ->
    ids``, ``token_bytes(id) -> bytes``, ``vocab_size`` and ``end_of_text`` (an id) will do.
    Its parts stay reachable as ``tokenizer`` and ``generator``.
    """

    def __init__(self, model, *, tokenizer=None, **engine):
        if "sample_below" in engine:
            raise TypeError("sample_below is set from the tokenizer's vocabulary: leave it out")
        self.tokenizer = WorldTokenizer() if tokenizer is None else tokenizer
        known = self.tokenizer.vocab_size
        below = known if known < model.config.vocab_size else None
        self.generator = Generator(model, sample_below=below, **engine)

    def generate(self, prompts: str | Sequence[str], *, max_new_tokens: int,
                 sampling: Sampling = Sampling(), stop: str | Sequence[str] = (),
                 on_text: Callable[[str], object] | Sequence | None = None,
                 seed: int = 0) -> TextGeneration:
        """Continue each prompt by up to ``max_new_tokens`` tokens; a prompt's text ends at the
        end-of-text token or before the first of the ``stop`` strings it reaches.

        ``on_text`` streams: one callable per prompt (a bare callable for a str prompt, a list
        of callables or None for a list of prompts), called with each new piece of that
        prompt's text as soon as it is complete (whole characters, no part of a stop string);
        the pieces add up to the returned text. Prompts run ``max_batch`` at a time with
        continuous batching; ``sampling`` and ``seed`` as in :meth:`Generator.generate`."""
        single = isinstance(prompts, str)
        texts = _strings("prompts", [prompts] if single else prompts)
        if not texts:
            raise ValueError("prompts must hold at least one prompt, got an empty list")
        stops = _strings("stop", [stop] if isinstance(stop, str) else stop)
        callbacks = [on_text] if single else [None] * len(texts) if on_text is None else on_text
        if (isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence)
                or len(callbacks) != len(texts)
                or not all(c is None or callable(c) for c in callbacks)):
            raise TypeError(f"on_text must be one callable (or None) per prompt: a callable "
                            f"for a str prompt, a list of them for a list of prompts "
                            f"({len(texts)} here), got {on_text!r}")
        streams = [_TextStream(self.tokenizer.token_bytes, stops, callback)
                   for callback in callbacks]
        generation = self.generator.generate(
            [self.tokenizer.encode(text) for text in texts], max_new_tokens=max_new_tokens,
            sampling=sampling, stop_tokens=[self.tokenizer.end_of_text], seed=seed,
            on_tokens=lambda i, tokens, finished: streams[i].push(tokens, finished))
        finish = ["stop" if stream.stopped else "end" if reason == "stop" else "length"
                  for stream, reason in zip(streams, generation.finish)]
        return TextGeneration([stream.text for stream in streams], finish, generation)
