"""Generating one sequence over the models' explicit state, on mlx-lm's machinery.

Entry points: ``stream_generate`` and ``generate`` (also ``mlx_rwkvx.stream_generate`` and
``mlx_rwkvx.generate``); ``Session``, a text's tokens and the model's state after them.
From mlx-lm: the decode loop (``generate_step``, one step ahead of its caller), its samplers and
logits processors (``make_sampler``, ``make_logits_processors``), its streaming detokenizer
(``NaiveStreamingDetokenizer``, or the tokenizer's own when it brings one), its text state
machine for stop strings (``TextStateMachine``: text that may begin a stop string waits),
``GenerationResponse`` and ``wired_limit``. Ours, where mlx-lm does not do it for these models:

- the prefill (``Session.feed``): pieces of ``prefill_step`` tokens through ``Model.hidden``,
  the head on the last position only. ``generate_step``'s prefill of the same model runs the
  prompt's last token as a step of its own: as fast on a long prompt, a decode step slower on a
  chat turn's (benchmarks/BENCHMARKS.md, generate section). Ours also leaves the state after
  the prompt, which the chat keeps as its snapshot before an answer;
- the attention blocks' ``max_cache`` window (mlx-lm's ``make_prompt_cache`` ignores
  ``max_kv_size`` for a model with its own ``make_cache``): past it MoBA drops whole chunks and
  Qwen2 keeps its last keys turned back to their new positions (``Model.trim_state``), or, with
  ``window=False``, a prompt that does not fit is refused and an answer stops with
  ``finish_reason="cache"``. ``generate_step`` steps through ``_Stepper``, which holds the
  session's state and trims it after every token;
- a detokenizer for byte-level vocabularies (RWKV World, bytes), for which mlx-lm has none.
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Callable, Iterator, Sequence

from mlx_rwkvx._mlx_lm import (
    GenerationResponse,
    NaiveStreamingDetokenizer,
    StreamingDetokenizer,
    TextStateMachine,
    generate_step,
    generation_stream,
    make_logits_processors,
    make_sampler,
    wired_limit,
)
from mlx_rwkvx.errors import GenerationError, UserError
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.settings import bounds_problem

import mlx.core as mx

DEFAULT_MAX_CACHE = 2048  # Foundry's KV cache length
DEFAULT_PREFILL_STEP = 2048  # tokens per parallel prefill piece
# the sampling arguments' limits: generate's and the server's flags declare these, and
# generate() checks its own arguments against them
SAMPLING_LIMITS = {
    "temp": dict(ge=0),
    "top_p": dict(ge=0, le=1),
    "min_p": dict(ge=0, le=1),
    "top_k": dict(ge=0),
    "repetition_penalty": dict(gt=0),
    "seed": dict(ge=0, le=2**64 - 1),  # MLX's generator takes a seed in [0, 2^64)
}


def default_max_cache(model: Model) -> int:
    """The KV cache length a model's attention blocks keep unless told: its config's own (a
    long-context checkpoint records one), else Foundry's 2048."""
    return model.config.max_cache or DEFAULT_MAX_CACHE


def _has_attention(model: Model) -> bool:
    return any(layer.kind != "rwkv7" for layer in model.layers)


def _cache_length(state) -> int:
    return max((s["keys"].shape[2] for s in state if "keys" in s), default=0)


class Session:
    """A text's tokens so far and the model's state after them (batch 1).

    ``feed(ids)`` prefills ids and returns the next-token logits; ``step(token, state)`` is
    the one-token step (``compile_step``: under ``mx.compile``). ``state`` is a plain pytree of
    immutable arrays: keeping a reference to it is a free snapshot. ``logits``: the next-token
    logits after ``tokens`` where known (after ``feed``, or restored with a snapshot), so that
    ``feed([])`` can start an answer with no token to feed."""

    def __init__(
        self,
        model: Model,
        *,
        max_cache: int | None = None,
        window: bool = True,
        prefill_step: int = DEFAULT_PREFILL_STEP,
        compile_step: bool = False,
    ):
        if max_cache is None:
            max_cache = default_max_cache(model)
        for name, value in (("max_cache", max_cache), ("prefill_step", prefill_step)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GenerationError(f"{name} must be a positive int, got {value!r}")
        self.model = model
        self.max_cache, self.window, self.prefill_step = max_cache, window, prefill_step
        self.attention = _has_attention(model)
        self.tokens: list[int] = []
        self.state: list | None = None
        self.logits: mx.array | None = None
        # the one-token step, eager unless asked (benchmarks/BENCHMARKS.md, generate, times both)
        self._step = mx.compile(self._forward) if compile_step else self._forward

    def _forward(self, tokens, state):
        h, state = self.model.hidden(tokens, state, check=False)
        return self.model.head(h[:, -1]).astype(mx.float32), state  # [1, vocab]

    def reset(self) -> None:
        self.tokens, self.state, self.logits = [], None, None

    def snapshot(self) -> tuple[list[int], list | None]:
        return list(self.tokens), self.state

    def restore(self, snap: tuple[list[int], list | None], logits: mx.array | None = None) -> None:
        """Continue from a snapshot (``logits``: the next-token logits after it, if known)."""
        self.tokens, self.state, self.logits = list(snap[0]), snap[1], logits

    @property
    def cache_full(self) -> bool:
        """Whether the next token would not fit in an attention block's cache (window off)."""
        return (
            self.attention
            and not self.window
            and self.state is not None
            and _cache_length(self.state) >= self.max_cache
        )

    def _trimmed(self, state):
        if self.attention and self.window and _cache_length(state) > self.max_cache:
            return self.model.trim_state(state, self.max_cache)
        return state

    def feed(self, ids: Sequence[int]) -> mx.array:
        """Prefill ``ids`` after the tokens so far: logits ``[1, vocab]`` (float32) of the
        token after them (``ids`` may be empty when ``logits`` holds them). Raises
        GenerationError for an id outside the vocabulary and, without the window, for ids that
        do not fit in the cache; the session is unchanged then."""
        ids = [int(i) for i in ids]
        if not ids and self.logits is not None:  # the logits after the tokens so far
            return self.logits
        if not ids:
            raise GenerationError("generate: nothing to feed (an empty prompt)")
        model = self.model
        vocab = model.config.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)  # Python ints: no read back
        if bad is not None:
            raise GenerationError(
                f"generate: token id {bad} is outside the vocabulary (0 .. {vocab - 1})"
            )
        if self.attention and not self.window:
            have = _cache_length(self.state) if self.state is not None else 0
            if have + len(ids) > self.max_cache:
                raise GenerationError(
                    f"generate: {have + len(ids)} tokens do not fit in the KV cache of "
                    f"{self.max_cache} (raise --max-cache, or allow the sliding window)"
                )
        state, logits = self.state, None
        for start in range(0, len(ids), self.prefill_step):
            piece = mx.array([ids[start : start + self.prefill_step]], dtype=mx.int32)
            h, state = model.hidden(piece, state, check=False)
            state = self._trimmed(state)
            if start + self.prefill_step >= len(ids):
                logits = model.head(h[:, -1]).astype(mx.float32)
                mx.eval(logits, state)
            else:
                mx.eval(state)
        # one assignment: Ctrl-C safe
        self.tokens, self.state, self.logits = self.tokens + ids, state, logits
        return logits

    def step(self, tokens: mx.array, state: list | None) -> tuple[mx.array, list]:
        """The one-token step after ``state`` (None: the start of a text), not evaluated:
        (logits ``[1, vocab]``, the state after it, within the window)."""
        if state is None:
            state = self.model.init_state(1)
        logits, state = self._step(tokens.reshape(1, 1), state)
        return logits, self._trimmed(state)


class _Stepper:
    """The model as mlx-lm's ``generate_step`` calls it, ``(tokens [1, 1], cache) -> logits
    [1, 1, vocab]``, over a session's state rather than a cache: the window trims after every
    token. It keeps the states after its last two steps, so that the session can hold every
    token but the last one sampled, which ``generate_step`` feeds one step ahead of its
    caller."""

    def __init__(self, session: Session):
        self.session = session
        self.fed = 0
        self.states = {0: session.state}  # tokens fed -> the state after them

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        logits, state = self.session.step(tokens, self.states[self.fed])
        self.fed += 1
        self.states[self.fed] = state
        self.states.pop(self.fed - 2, None)
        return logits[:, None]


class _ByteDetokenizer(StreamingDetokenizer):
    """mlx-lm's streaming detokenizer for a byte-level vocabulary (a tokenizer with
    ``decode_bytes``: RWKV World, bytes), for which mlx-lm has none: each token's bytes through
    one incremental UTF-8 decoder, a character split across tokens waiting for its last byte
    (mlx-lm's naive one decodes the whole line again at every token)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.reset()

    def reset(self):
        self.offset, self.tokens, self.text = 0, [], ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add_token(self, token):
        self.tokens.append(token)
        self.text += self._decoder.decode(self.tokenizer.decode_bytes([token]))

    def finalize(self):
        self.text += self._decoder.decode(b"", final=True)


class _TextOnly:
    """A tokenizer as mlx-lm's naive detokenizer calls it (``encode(text,
    add_special_tokens=...)``, ``decode(ids)``), for one that takes the text alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)


def detokenizer(tokenizer) -> StreamingDetokenizer:
    if hasattr(tokenizer, "decode_bytes"):
        return _ByteDetokenizer(tokenizer)
    own = getattr(tokenizer, "detokenizer", None)  # mlx-lm's TokenizerWrapper: a fresh one
    if isinstance(own, StreamingDetokenizer):
        return own
    return NaiveStreamingDetokenizer(_TextOnly(tokenizer))


class StopStrings:
    """The stop strings, over mlx-lm's ``TextStateMachine``: text that may be the start of a
    stop string (split across tokens) is held back, and the text ends before the first stop
    string completed."""

    def __init__(self, stops: Sequence[str]):
        stops = [s for s in stops if s]
        machine = TextStateMachine({"normal": [(s, None) for s in stops]} if stops else None)
        self.state = machine.make_state()

    def add(self, text: str) -> tuple[str, bool]:
        """(text safe to show, whether a stop string was reached: the text is cut before it)."""
        self.state, segments = TextStateMachine.split(self.state, text)
        return "".join(t for _, t in segments), self.state[0] is None

    def flush(self) -> str:
        """The text held back (none after a stop string)."""
        if self.state[0] is None:
            return ""
        self.state, text, _ = TextStateMachine.flush(self.state)
        return text


def _sampling(
    sampler, logits_processors, temp, top_p, min_p, top_k, repetition_penalty, seed
) -> tuple[Callable, list]:
    given = dict(
        temp=temp, top_p=top_p, min_p=min_p, top_k=top_k, repetition_penalty=repetition_penalty
    )
    for name, value in given.items():
        if value is None and name == "repetition_penalty":
            continue
        if not _number(value):
            raise GenerationError(f"generate: {name} must be a finite number, got {value!r}")
        problem = bounds_problem(value, **SAMPLING_LIMITS[name])
        if problem:
            raise GenerationError(f"generate: {name} {problem}")
    if seed is not None:
        if not (isinstance(seed, int) and not isinstance(seed, bool)):
            raise GenerationError(f"generate: seed must be an int in 0 .. 2^64 - 1, got {seed!r}")
        problem = bounds_problem(seed, **SAMPLING_LIMITS["seed"])
        if problem:
            raise GenerationError(f"generate: seed {problem}")
        mx.random.seed(seed)
    if sampler is not None and not callable(sampler):
        raise TypeError(f"generate: sampler must be a function of the logits, got {sampler!r}")
    if sampler is None:
        sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=int(top_k))
    if logits_processors is None:
        logits_processors = make_logits_processors(repetition_penalty=repetition_penalty)
    return sampler, list(logits_processors)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def vocab_mask(known: int, vocab: int):
    mask = mx.where(mx.arange(vocab) < known, 0.0, -mx.inf)

    def processor(tokens, logits):
        return logits + mask

    return processor


def _after(history: mx.array, processor):
    """``processor`` seeing ``history`` before the tokens ``generate_step`` fed (it knows only
    those): the session's tokens and the prompt, as for the first token."""

    def seeing_all(tokens, logits):
        return processor(mx.concatenate([history, tokens.astype(history.dtype)]), logits)

    return seeing_all


def _sample(logits, history, processors, sampler):
    """The first token as ``generate_step`` samples every later one."""
    for processor in processors:
        logits = processor(history, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text)``; text it cannot encode is a ``GenerationError`` naming it."""
    try:
        return tokenizer.encode(text)
    except UserError:
        raise
    except ValueError as e:  # the tokenizers' word for text they cannot encode
        raise GenerationError(f"generate: the tokenizer cannot encode the text ({e})") from e


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt)
    if isinstance(prompt, mx.array):
        return [int(i) for i in prompt.reshape(-1).tolist()]
    if isinstance(prompt, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in prompt
    ):
        return list(prompt)
    raise TypeError(
        f"generate: prompt must be a str or a list of token ids, got {type(prompt).__name__}"
    )


def stream_generate(
    model: Model,
    tokenizer,
    prompt,
    *,
    max_tokens: int = 256,
    sampler: Callable | None = None,
    logits_processors: list | None = None,
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    top_k: int = 0,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    max_cache: int | None = None,
    window: bool = True,
    prefill_step: int = DEFAULT_PREFILL_STEP,
    session: Session | None = None,
    max_kv_size: int | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt`` (text, or token ids), yielding one mlx-lm
    ``GenerationResponse`` per token. Stops at the tokenizer's end-of-text ids, at any of the
    ``stop`` strings (also when split across tokens; the stop string is not shown), after
    ``max_tokens``, or (``window=False``) when the KV cache is full: ``finish_reason`` is
    ``"stop"``, ``"length"`` or ``"cache"`` on the last response, None before it. ``text`` may
    be empty (a token that ends inside a character, or text held back while it may still
    become a stop string).

    ``temp``, ``top_p``, ``min_p``, ``top_k``, ``repetition_penalty``: mlx-lm's sampler and
    logits processors (or pass ``sampler`` / ``logits_processors`` made with them); ``seed``
    seeds MLX's generator. ``session``: continue a ``Session`` (its tokens and state); the
    prompt's tokens are fed after them, and the session holds every fed token at the end (the
    last sampled token is not fed). ``max_kv_size``: mlx-lm's name for ``max_cache``.
    ``tokenizer``: ``encode(text)``, ``decode(ids)``, ``eos_token_ids`` (what ``mlx_rwkvx.load``
    returns, or an mlx-lm ``TokenizerWrapper``).
    """
    if not isinstance(model, Model):
        raise TypeError(f"generate: model must be an mlx_rwkvx Model, got {type(model).__name__}")
    if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"generate: tokenizer must have encode and decode (mlx_rwkvx.load returns it), got "
            f"{type(tokenizer).__name__}"
        )
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise GenerationError(f"generate: max_tokens must be a positive int, got {max_tokens!r}")
    if isinstance(stop, str):
        stop = [stop]
    sampler, processors = _sampling(
        sampler, logits_processors, temp, top_p, min_p, top_k, repetition_penalty, seed
    )
    if session is None:
        session = Session(
            model,
            max_cache=max_kv_size or max_cache,
            window=window,
            prefill_step=prefill_step,
        )
    ids = _prompt_ids(tokenizer, prompt)
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    detok, stops = detokenizer(tokenizer), StopStrings(stop)
    history = mx.array(session.tokens + ids, dtype=mx.int32)  # what the processors look back on
    known = getattr(tokenizer, "vocab_size", None)
    if known is not None and known < model.config.vocab_size:
        # a head wider than the tokenizer (padded rows): never sample an id it cannot decode
        processors.insert(0, vocab_mask(known, model.config.vocab_size))
    yield from _generate(
        model, session, ids, history, sampler, processors, detok, stops, eos, max_tokens
    )


def _generate(model, session, ids, history, sampler, processors, detok, stops, eos, max_tokens):
    steps = None  # mlx-lm's generate_step, from the second token on
    with wired_limit(model, [generation_stream]):
        try:
            mx.reset_peak_memory()
            tic = time.perf_counter()
            y, logprobs = _sample(session.feed(ids), history, processors, sampler)
            mx.eval(y, logprobs)
            prompt_tps = len(ids) / max(time.perf_counter() - tic, 1e-9)
            tic = time.perf_counter()
            token, logprobs = int(y.item()), logprobs[0]
            stepper, n = _Stepper(session), 0
            while True:
                n += 1
                finish = None
                if token in eos:
                    detok.finalize()
                    text, finish = stops.flush() + detok.last_segment, "stop"
                else:
                    detok.add_token(token)
                    text, stopped = stops.add(detok.last_segment)
                    if stopped:
                        finish = "stop"
                    elif n >= max_tokens:
                        finish = "length"
                    elif session.cache_full:
                        finish = "cache"
                    if finish is not None and not stopped:
                        detok.finalize()
                        text += stops.add(detok.last_segment)[0] + stops.flush()
                yield GenerationResponse(
                    text=text,
                    token=token,
                    logprobs=logprobs,
                    from_draft=False,
                    prompt_tokens=len(ids),
                    prompt_tps=prompt_tps,
                    generation_tokens=n,
                    generation_tps=n / max(time.perf_counter() - tic, 1e-9),
                    peak_memory=mx.get_peak_memory() / 1e9,
                    finish_reason=finish,
                )
                if finish is not None:
                    return
                if steps is None:
                    steps = generate_step(
                        mx.array([token], dtype=mx.int32),
                        stepper,
                        max_tokens=max_tokens - 1,
                        sampler=sampler,
                        logits_processors=[_after(history, p) for p in processors],
                        prompt_cache=[],  # the state lives in the stepper
                    )
                fed = token
                token, logprobs = next(steps)
                # the session holds every token but the one just sampled: one assignment
                session.tokens, session.state, session.logits = (
                    session.tokens + [fed],
                    stepper.states[n],
                    None,
                )
        finally:
            if steps is not None:
                steps.close()


def generate(model: Model, tokenizer, prompt, *, verbose: bool = False, **opts) -> str:
    """The text ``stream_generate(model, tokenizer, prompt, **opts)`` generates. ``verbose``
    prints it as it comes and then the token counts and speeds."""
    text, last = [], None
    for last in stream_generate(model, tokenizer, prompt, **opts):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s; generation: "
            f"{last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s; peak "
            f"memory {last.peak_memory:.2f} GB"
        )
    return "".join(text)
