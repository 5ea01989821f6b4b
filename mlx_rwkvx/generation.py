"""Generation over the models' explicit state: ``stream_generate`` / ``generate`` (the Python
API, also ``mlx_rwkvx.generate`` and ``mlx_rwkvx.stream_generate``), the ``Session`` that holds
a text's tokens and the state after them, and the ``Chat`` that carries a conversation from turn
to turn so that each turn prefills only its new tokens.

Prefill runs the parallel path (``Model.hidden``) in pieces of at most ``prefill_step`` tokens
and the head on the last position only; decoding is the one-token step. RWKV blocks' state is
constant-size; attention blocks' KV caches hold at most ``max_cache`` tokens: past it either a
sliding window (``Model.trim_state``: MoBA drops whole chunks, Qwen2 keeps the last
``max_cache`` keys turned back to their new positions) or, with ``window=False``, generation
stops with ``finish_reason="cache"``. Sampling and logits processors are mlx-lm's
(``make_sampler``, ``make_logits_processors``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from mlx_rwkvx.io.atomic import CheckpointError, atomic_target, check_target, save_safetensors
from mlx_rwkvx.io.tensors import read_safetensors
from mlx_rwkvx.io.tokenizers import rwkv_chat_text
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.tuner.adapters import adapter_tensors, fingerprint

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.sample_utils import make_logits_processors, make_sampler

DEFAULT_MAX_CACHE = 2048  # the seeds' KV cache length
DEFAULT_PREFILL_STEP = 2048  # tokens per parallel prefill piece
STATE_FORMAT = "mlx_rwkvx.chat/1"  # the metadata tag of a saved conversation


@dataclass
class GenerationResponse:
    """One generated token and the text it completes (mlx-lm's ``GenerationResponse`` fields).

    ``text`` may be empty (a token that ends inside a character, or text held back while it
    may still become a stop string); ``finish_reason`` is None until the last response:
    ``"stop"`` (end of text or a stop string), ``"length"`` (``max_tokens``), ``"cache"`` (the
    KV cache is full and ``window=False``)."""

    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None
    from_draft: bool = False


def _has_attention(model: Model) -> bool:
    return any(layer.kind != "rwkv7" for layer in model.layers)


def _cache_length(state) -> int:
    return max((s["keys"].shape[2] for s in state if "keys" in s), default=0)


class Session:
    """A text's tokens so far and the model's state after them (batch 1).

    ``feed(ids)`` prefills ids and returns the next-token logits; ``step(token)`` feeds one
    sampled token. ``state`` is a plain pytree of immutable arrays: keeping a reference to it
    is a free snapshot."""

    def __init__(
        self,
        model: Model,
        *,
        max_cache: int = DEFAULT_MAX_CACHE,
        window: bool = True,
        prefill_step: int = DEFAULT_PREFILL_STEP,
    ):
        for name, value in (("max_cache", max_cache), ("prefill_step", prefill_step)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model = model
        self.max_cache, self.window, self.prefill_step = max_cache, window, prefill_step
        self.attention = _has_attention(model)
        self.tokens: list[int] = []
        self.state: list | None = None
        # the one-token step, not compiled: mx.compile of it measured slower on the CPU
        # (BENCHMARKS.md, generate section)
        self._step = self._forward

    def _forward(self, tokens, state):
        h, state = self.model.hidden(tokens, state, check=False)
        return self.model.head(h[:, -1]).astype(mx.float32), state  # [1, vocab]

    def reset(self) -> None:
        self.tokens, self.state = [], None

    def snapshot(self) -> tuple[list[int], list | None]:
        return list(self.tokens), self.state

    def restore(self, snap: tuple[list[int], list | None]) -> None:
        self.tokens, self.state = list(snap[0]), snap[1]

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
        """Prefill ``ids`` (at least one) after the tokens so far: logits ``[1, vocab]``
        (float32) of the token after them. The ids are checked against the vocabulary once.
        Without the window, raises ValueError when they do not fit in the cache."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("generate: nothing to feed (an empty prompt)")
        model = self.model
        model.check_tokens(mx.array([ids], dtype=mx.int32))  # one read back for the whole text
        if self.attention and not self.window:
            have = _cache_length(self.state) if self.state is not None else 0
            if have + len(ids) > self.max_cache:
                raise ValueError(
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
        self.tokens, self.state = self.tokens + ids, state  # one assignment: Ctrl-C safe
        return logits

    def step_lazy(self, token: mx.array):
        """The one-token step, not evaluated: (logits ``[1, vocab]``, state after it)."""
        state = self.state if self.state is not None else self.model.init_state(1)
        logits, state = self._step(token.reshape(1, 1), state)
        return logits, self._trimmed(state)


class _Detokenizer:
    """Token ids -> text as it becomes complete: byte tokenizers through an incremental UTF-8
    decoder, others by decoding all ids so far (a character split across tokens waits)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.by_bytes = hasattr(tokenizer, "decode_bytes")
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.emitted = 0

    def add(self, token: int) -> str:
        if self.by_bytes:
            return self.decoder.decode(self.tokenizer.decode_bytes([token]))
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted :], len(text)
        return new

    def finish(self) -> str:
        if self.by_bytes:
            return self.decoder.decode(b"", final=True)
        text = self.tokenizer.decode(self.ids)
        return text[self.emitted :]


class _StopStrings:
    """Holds back text that may be the start of a stop string (split across tokens) and finds
    the first stop string in what was generated."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def add(self, text: str) -> tuple[str, bool]:
        """(text safe to show, whether a stop string was reached: the text is cut before it)."""
        self.pending += text
        cuts = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if cuts:
            out, self.pending = self.pending[: min(cuts)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _sampling(
    sampler, logits_processors, temp, top_p, min_p, top_k, repetition_penalty, seed
) -> tuple[Callable, list]:
    for name, value, lo in (
        ("temp", temp, 0.0),
        ("top_p", top_p, 0.0),
        ("min_p", min_p, 0.0),
        ("top_k", top_k, 0),
    ):
        if not _number(value) or not value >= lo:
            raise ValueError(f"generate: {name} must be a finite number >= {lo}, got {value!r}")
    if top_p > 1 or min_p > 1:
        raise ValueError(f"generate: top_p and min_p must be at most 1, got {top_p}, {min_p}")
    if repetition_penalty is not None and not (
        _number(repetition_penalty) and repetition_penalty > 0
    ):
        raise ValueError(
            f"generate: repetition_penalty must be a positive number, got {repetition_penalty!r}"
        )
    if seed is not None:
        if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64):
            raise ValueError(f"generate: seed must be an int in 0 .. 2^64 - 1, got {seed!r}")
        mx.random.seed(seed)
    if sampler is not None and not callable(sampler):
        raise TypeError(f"generate: sampler must be a function of the logits, got {sampler!r}")
    if sampler is None:
        sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=int(top_k))
    if logits_processors is None:
        logits_processors = make_logits_processors(repetition_penalty=repetition_penalty)
    return sampler, list(logits_processors)


def _number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))  # fmt: skip


def _vocab_mask(known: int, vocab: int):
    mask = mx.where(mx.arange(vocab) < known, 0.0, -mx.inf)

    def processor(tokens, logits):
        return logits + mask

    return processor


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
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
    max_cache: int = DEFAULT_MAX_CACHE,
    window: bool = True,
    prefill_step: int = DEFAULT_PREFILL_STEP,
    session: Session | None = None,
    max_kv_size: int | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt`` (text, or token ids), yielding one ``GenerationResponse`` per
    token. Stops at the tokenizer's end-of-text ids, at any of the ``stop`` strings (also when
    split across tokens; the stop string is not shown), or after ``max_tokens``.

    ``temp``, ``top_p``, ``min_p``, ``top_k``, ``repetition_penalty``: mlx-lm's sampler and
    logits processors (or pass ``sampler`` / ``logits_processors`` made with them); ``seed``
    seeds MLX's generator. ``session``: continue a ``Session`` (its tokens and state); the
    prompt's tokens are fed after them, and the session holds every fed token at the end (the
    last sampled token is not fed). ``max_kv_size``: mlx-lm's name for ``max_cache``.
    """
    if not isinstance(model, Model):
        raise TypeError(f"generate: model must be an mlx_rwkvx Model, got {type(model).__name__}")
    if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"generate: tokenizer must have encode and decode (mlx_rwkvx.load returns it), got "
            f"{type(tokenizer).__name__}"
        )
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"generate: max_tokens must be a positive int, got {max_tokens!r}")
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
    detok, stops = _Detokenizer(tokenizer), _StopStrings(stop)
    seen = mx.array(session.tokens + ids, dtype=mx.int32)  # what the processors look back on
    known = getattr(tokenizer, "vocab_size", None)
    if known is not None and known < model.config.vocab_size:
        # a head wider than the tokenizer (padded rows): never sample an id it cannot decode
        processors.insert(0, _vocab_mask(known, model.config.vocab_size))

    def sample(logits):
        nonlocal seen
        for processor in processors:
            logits = processor(seen, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs

    mx.reset_peak_memory()
    tic = time.perf_counter()
    logits = session.feed(ids)
    y, logprobs = sample(logits)
    mx.eval(y, logprobs)
    prompt_tps = len(ids) / max(time.perf_counter() - tic, 1e-9)
    tic = time.perf_counter()
    n = 0
    while True:
        token = int(y.item())
        n += 1
        finish = None
        if token in eos:
            text, finish = stops.flush() + detok.finish(), "stop"
        else:
            text, stopped = stops.add(detok.add(token))
            if stopped:
                finish = "stop"
            elif n >= max_tokens:
                finish = "length"
            elif session.cache_full:
                finish = "cache"
            if finish is not None and not stopped:
                text += stops.add(detok.finish())[0] + stops.flush()
        if finish is None:  # the next step runs while this token is shown
            seen = mx.concatenate([seen, y.reshape(1).astype(mx.int32)])
            next_logits, next_state = session.step_lazy(y)
            next_y, next_logprobs = sample(next_logits)
            mx.async_eval(next_y, next_logprobs, next_state)
        yield GenerationResponse(
            text=text,
            token=token,
            logprobs=logprobs[0],
            prompt_tokens=len(ids),
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
        )
        if finish is not None:
            return
        mx.eval(next_y)
        session.tokens, session.state = session.tokens + [token], next_state
        y, logprobs = next_y, next_logprobs


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


# ----- chat templates --------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATE_NAMES = ("rwkv", "chatml")
RWKV_STOP = "\n\n"  # an RWKV World chat turn ends with a blank line, not with token 0


@dataclass
class ChatFormat:
    """How a conversation becomes text: ``render(messages, add_generation_prompt)``, the stop
    strings that end an answer, and a name (for saved conversations)."""

    name: str
    render: Callable[[list[dict], bool], str]
    stops: list[str] = field(default_factory=list)


def _jinja(template: str) -> Callable[[list[dict], bool], str]:
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(messages, add_generation_prompt):
        rendered, _ = render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=add_generation_prompt
        )
        return rendered[0]

    return render


def chat_format(tokenizer, template: str | None = None) -> ChatFormat:
    """The conversation format: ``template`` None takes the tokenizer's own chat template
    (through transformers' ``apply_chat_template``) where it has one, else RWKV's
    ``User: ...\\n\\nAssistant: ...`` convention; or a name (``rwkv``, ``chatml``) or the path
    of a Jinja template file. Raises ValueError for an unknown name or an unreadable file."""
    if template is None:
        if getattr(tokenizer, "chat_template", None):

            def render(messages, add_generation_prompt):
                return tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=False
                )

            return ChatFormat("tokenizer", render, _im_end_stop(tokenizer, tokenizer.chat_template))
        template = "rwkv"
    if template == "rwkv":
        return ChatFormat("rwkv", rwkv_chat_text, [RWKV_STOP])
    if template == "chatml":
        return ChatFormat("chatml", _jinja(CHATML), _im_end_stop(tokenizer, force=True))
    if not os.path.isfile(template):
        raise ValueError(
            f"chat template {template!r}: neither one of {list(TEMPLATE_NAMES)} nor a file"
        )
    try:
        with open(template, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"chat template {template}: cannot read it ({e})") from e
    render = _jinja(text)
    probe = "<probe: the user's words>"
    try:
        rendered = render([{"role": "user", "content": probe}], True)
    except Exception as e:  # jinja2's own errors: a template that does not render
        raise ValueError(f"chat template {template}: does not render ({e})") from e
    if probe not in rendered:  # a file that is not a template renders as itself
        raise ValueError(
            f"chat template {template}: does not render the messages (their text is not in "
            "what it writes): not a chat template?"
        )
    return ChatFormat(os.path.abspath(template), render, _im_end_stop(tokenizer, text))


def _im_end_stop(tokenizer, template: str | None = None, force: bool = False) -> list[str]:
    """ChatML's turns end with ``<|im_end|>``: a stop string for a template that writes it
    (or ``force``), unless it is one token and one of the tokenizer's end-of-text ids (a Qwen2
    base tokenizer ends texts with ``<|endoftext|>``, not ``<|im_end|>``)."""
    if not force and "<|im_end|>" not in (template or ""):
        return []
    ids = tokenizer.encode("<|im_end|>") if tokenizer is not None else []
    eos = getattr(tokenizer, "eos_token_ids", set()) or set()
    return [] if len(ids) == 1 and ids[0] in eos else ["<|im_end|>"]


# ----- the chat --------------------------------------------------------------------------------


def is_conversation(path: str) -> bool:
    """Whether ``path`` is a conversation ``Chat.save`` wrote (its metadata says so)."""
    try:
        _, meta = read_safetensors(path)
    except CheckpointError:
        return False
    return meta.get("format") == STATE_FORMAT


class Chat:
    """A conversation: its messages, and a ``Session`` holding every token fed so far.

    Each ``ask`` renders the whole conversation with the new user message and feeds only the
    text past what the session already holds (the state after the previous answer), so a turn
    costs its own tokens. When the rendering does not continue the text fed so far (a
    tokenizer that spells the answer differently, a template that rewrites earlier turns), it
    continues from the state before the previous answer, and failing that from the start: the
    state always equals a prefill of ``session.tokens``."""

    def __init__(
        self,
        model: Model,
        tokenizer,
        *,
        template: str | None = None,
        system: str | None = None,
        **options,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.template = template
        self.format = chat_format(tokenizer, template)
        if "max_kv_size" in options:  # mlx-lm's name
            options["max_cache"] = options.pop("max_kv_size")
        gen = {k: options.pop(k) for k in ("max_cache", "window", "prefill_step") if k in options}
        self.options = options  # sampling and max_tokens for every turn
        self.session = Session(model, **gen)
        self.system = system
        self.messages: list[dict] = []
        self._before_answer: tuple[list[int], list | None] | None = None
        self.reused = 0  # tokens of the held state the last turn continued from
        self.prefilled = 0  # tokens the last turn fed before its answer

    def reset(self, system: str | None | bool = False) -> None:
        """Start a new conversation (``system``: a new system prompt; False keeps it)."""
        if system is not False:
            self.system = system
        self.messages, self._before_answer = [], None
        self.session.reset()

    def _conversation(self, user: str | None = None) -> list[dict]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages += self.messages
        if user is not None:
            messages.append({"role": "user", "content": user})
        return messages

    def _fed_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if tokens else ""

    def _continue(self, text: str) -> list[int]:
        """Bring the session to the latest held state whose text ``text`` continues (after
        the previous answer, else before it, else the start); the ids still to feed."""
        held = [self.session.snapshot()]
        if self._before_answer is not None:
            held.append(self._before_answer)
        for snap in held:
            done = self._fed_text(snap[0])
            if snap[0] and text.startswith(done) and len(text) > len(done):
                self.session.restore(snap)
                self.reused = len(snap[0])
                return self.tokenizer.encode(text[len(done) :])
        self.session.reset()
        self.reused = 0
        return self.tokenizer.encode(text)

    def ask(self, user: str, **options) -> Iterator[GenerationResponse]:
        """Stream the answer to ``user``; the conversation then holds both (an answer stopped
        early, by Ctrl-C or ``close()``, is kept as far as it came)."""
        if not isinstance(user, str):
            raise TypeError(f"chat: the message must be a str, got {type(user).__name__}")
        text = self.format.render(self._conversation(user), True)
        opts = {**self.options, **options}
        stops = list(self.format.stops) + list(opts.pop("stop", ()))
        ids = self._continue(text)
        self.prefilled = len(ids)
        responses = stream_generate(
            self.model, self.tokenizer, ids, stop=stops, session=self.session, **opts
        )
        first = next(responses)  # the prompt is in: the state before the answer
        self._before_answer = self.session.snapshot()
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": ""}]
        answer = self.messages[-1]
        pieces = [first.text]
        answer["content"] = self._content(pieces)
        yield first
        for response in responses:
            pieces.append(response.text)
            answer["content"] = self._content(pieces)
            yield response

    def _content(self, pieces: list[str]) -> str:
        # the answer as generated, so that the next rendering continues the text fed; in
        # RWKV's format less the space after "Assistant:" (the rendering puts it back)
        text = "".join(pieces)
        return text[1:] if self.format.name == "rwkv" and text.startswith(" ") else text

    # ----- saving and loading a conversation ---------------------------------------------------

    def identity(self) -> str:
        """The model a saved conversation belongs to: the base's fingerprint and a hash of any
        adapter tensors."""
        h = hashlib.sha256()
        for name, x in sorted(adapter_tensors(self.model).items()):
            h.update(name.encode())
            h.update(memoryview(x.astype(mx.float32)))
        return f"{fingerprint(self.model)}-{h.hexdigest()[:16]}"

    def save(self, path: str) -> None:
        """The whole conversation in one safetensors file, written atomically: messages,
        system prompt, the tokens fed and the state after them, and the state before the last
        answer (from which the next turn continues when the answer's rendering differs)."""
        path = os.fspath(path)
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path}: a conversation is saved as a .safetensors file")
        meta = {
            "format": STATE_FORMAT,
            "model": self.identity(),
            "messages": json.dumps(self.messages),
            "system": json.dumps(self.system),
            "template": self.format.name,
        }
        tensors = {}
        for name, snap in (("now", self.session.snapshot()), ("before", self._before_answer)):
            if snap is None:
                continue
            tokens, state = snap
            meta[f"{name}.tokens"] = str(len(tokens))
            tensors[f"{name}.tokens"] = mx.array(tokens or [0], dtype=mx.int32)
            if state is not None:  # an empty KV cache has no tensor: it comes from init_state
                tensors.update({f"{name}.{k}": v for k, v in tree_flatten(state) if v.size})
        # replaces a conversation saved before, never another file (a model, a document)
        check_target(path, overwrite=True, folder=False, recognise=is_conversation,
                     kind="a saved conversation")  # fmt: skip
        with atomic_target(path, folder=False) as tmp:
            save_safetensors(tmp, tensors, meta)

    def _snapshot_from(self, name: str, tensors: dict, meta: dict):
        if f"{name}.tokens" not in meta:
            return None
        n = int(meta[f"{name}.tokens"])
        tokens = [int(i) for i in tensors[f"{name}.tokens"].tolist()][:n]
        if len(tokens) != n:
            raise ValueError(f"{name}: {len(tokens)} tokens for {n}")
        if not n:
            return [], None
        flat = [
            (k, tensors.get(f"{name}.{k}", v) if v.size == 0 else tensors[f"{name}.{k}"])
            for k, v in tree_flatten(self.model.init_state(1))
        ]
        for k, v in flat:
            if mx.issubdtype(v.dtype, mx.floating) and not mx.all(mx.isfinite(v)).item():
                raise ValueError(f"{name}.{k} holds NaN or infinite values")
        state = tree_unflatten(flat)
        self.model.check_state(state, 1)
        return tokens, state

    def load(self, path: str) -> None:
        """Continue the conversation saved in ``path`` (by this or another process). Raises
        ValueError (a CheckpointError) for a file that is not one, or belongs to another model;
        the chat is unchanged then."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such file")
        try:
            tensors, meta = mx.load(path, return_metadata=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: not a saved conversation ({e})") from e
        if meta.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path}: not a saved conversation (no {STATE_FORMAT} tag)")
        if meta.get("model") != self.identity():
            raise CheckpointError(
                f"{path}: the conversation was saved with another model or adapter"
            )
        if meta.get("template") != self.format.name:
            raise CheckpointError(
                f"{path}: the conversation was saved in the {meta.get('template')!r} chat "
                f"format, this chat uses {self.format.name!r} (--chat-template)"
            )
        try:
            messages, system = json.loads(meta["messages"]), json.loads(meta["system"])
            now = self._snapshot_from("now", tensors, meta)
            before = self._snapshot_from("before", tensors, meta)
            if now is None or not isinstance(messages, list):
                raise ValueError("no state or no messages")
            for m in messages:
                if not (
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                ):
                    raise ValueError(f"a message that is not a role and a text: {m!r:.60}")
            if system is not None and not isinstance(system, str):
                raise ValueError("the system prompt is not a text")
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: a damaged conversation file ({e})") from e
        self.messages, self.system = messages, system
        self.session.restore(now)
        self._before_answer = before
