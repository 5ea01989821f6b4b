"""``python -m mlx_rwkvx.generate``: generate from a prompt, or chat.

With ``--prompt TEXT`` (``-`` reads standard input) it prints one answer; without it, on a
terminal (or with ``--chat``), it is an interactive chat whose state carries from turn to turn:
each turn prefills only its own tokens. Chat commands: ``/help``. Settings: ``GenerateConfig``
below (flags, mlx-lm's names as aliases, a YAML ``--config``). Entry point: ``main(argv)``; the
work is ``mlx_rwkvx.generation``'s.

Exit codes: 0 done; 2 a problem with what was given (one line: a ``UserError``); 130 or 143
Ctrl-C or SIGTERM; anything else is a bug and keeps its traceback.

This module is callable: ``mlx_rwkvx.generate(model, tokenizer, prompt)`` is the generation
function even after ``import mlx_rwkvx.generate`` made the package attribute this module.
"""

from __future__ import annotations

import os
import signal
import sys
import types
from dataclasses import dataclass

from mlx_rwkvx import cli, generation, settings
from mlx_rwkvx.adapters.apply import apply_adapter
from mlx_rwkvx.errors import UsageError, UserError
from mlx_rwkvx.generation import (
    DEFAULT_MAX_CACHE,
    Chat,
    chat_format,
    encode_chat,
    stream_generate,
)
from mlx_rwkvx.generation.stream import SAMPLING_LIMITS, default_max_cache
from mlx_rwkvx.io.hub import resolve_model
from mlx_rwkvx.io.load import load
from mlx_rwkvx.ops import configure_and_prepare
from mlx_rwkvx.settings import Settings, opt

import mlx.core as mx

PROG = "mlx_rwkvx.generate"


@dataclass
class GenerateConfig(Settings):
    """Generate text from an RWKV-7, RWKV-X or RFA model, or chat with it. Flags beat a
    --config file; the file beats the defaults."""

    model: str | None = opt("a checkpoint (any format mlx_rwkvx.load reads)", required=True)
    adapter: str | None = opt(
        "an adapter file or folder to apply (ours or mlx-lm's)", "adapter_path"
    )
    quantize: str | None = opt(
        "quantize the weights as they load (bare: int8)", choices=("int8", "int4"), const="int8"
    )
    dtype: str | None = opt(
        "cast the float weights: float32, bfloat16, float16 (default: as stored)",
        choices=("float32", "bfloat16", "float16"),
    )
    prompt: str | None = opt("the prompt ('-' reads standard input); without it: a chat", "p")
    chat: bool = opt(
        "an interactive chat even when standard input is not a terminal", default=False
    )
    system: str | None = opt("the system prompt", "system_prompt")
    chat_template: str | None = opt(
        "rwkv (User:/Assistant:), chatml, or a Jinja template file (default: the tokenizer's "
        "own, else rwkv)"
    )
    ignore_chat_template: bool = opt(
        "use the prompt as it is, with no chat template", default=False
    )
    max_tokens: int = opt("the most tokens an answer may have", "m", default=256, ge=1)
    temp: float = opt(
        "sampling temperature (0: greedy)", "temperature", default=0.0, **SAMPLING_LIMITS["temp"]
    )
    top_p: float = opt(
        "nucleus sampling: keep the most likely tokens up to this probability (0 or 1: off)",
        default=0.0,
        **SAMPLING_LIMITS["top_p"],
    )
    min_p: float = opt(
        "drop tokens less likely than this times the top one (0: off)",
        default=0.0,
        **SAMPLING_LIMITS["min_p"],
    )
    top_k: int = opt(
        "keep only the K most likely tokens (0: off)", default=0, **SAMPLING_LIMITS["top_k"]
    )
    repetition_penalty: float | None = opt(
        "divide the logits of recent tokens by this (> 1)", **SAMPLING_LIMITS["repetition_penalty"]
    )
    seed: int | None = opt("random seed of the sampler", **SAMPLING_LIMITS["seed"])
    stop: str | None = opt("one more string that ends an answer")
    max_cache: int | None = opt(
        "tokens the attention blocks' KV caches hold (default: the model's own, else "
        f"{DEFAULT_MAX_CACHE})",
        "max_kv_size",
        ge=1,
    )
    window: bool = opt(
        "past --max-cache, keep a sliding window of the last tokens (the default); --no-window "
        "stops the answer instead",
        default=True,
    )
    verbose: bool = opt(
        "print the prompt's and the answer's token counts and speeds", default=False
    )

    def check_together(self) -> None:
        if self.prompt is not None and self.chat:
            raise UsageError("--prompt answers once, --chat is a conversation: give one of them")
        if self.ignore_chat_template:
            given = [
                flag
                for flag, value in (
                    ("--system", self.system),
                    ("--chat-template", self.chat_template),
                )
                if value is not None
            ]
            if given:
                raise UsageError(
                    f"{' and '.join(given)} with --ignore-chat-template: the prompt goes in as "
                    "it is, with no template to carry them"
                )


def _sampling(cfg: GenerateConfig) -> dict:
    return dict(
        max_tokens=cfg.max_tokens,
        temp=cfg.temp,
        top_p=cfg.top_p if cfg.top_p < 1 else 0.0,  # 1: keep everything, i.e. off
        min_p=cfg.min_p,
        top_k=cfg.top_k,
        repetition_penalty=cfg.repetition_penalty,
        max_cache=cfg.max_cache,
        window=cfg.window,
    )


def _load(cfg: GenerateConfig):
    path = resolve_model(cfg.model)  # a Hugging Face name: its snapshot in the hub's cache
    if not os.path.exists(path):
        raise UsageError(f"--model {cfg.model}: no such file or folder")
    model, tokenizer = load(path, quantize=cfg.quantize, dtype=cfg.dtype)
    if cfg.adapter is not None:
        if not os.path.exists(cfg.adapter):
            raise UsageError(f"--adapter {cfg.adapter}: no such file or folder")
        apply_adapter(model, cfg.adapter)
    return model, tokenizer


def _prompt(cfg: GenerateConfig, tokenizer) -> tuple[str | list[int], list[str]]:
    """The prompt and its stop strings: rendered by the chat template where one applies (as
    token ids: special tokens only where the template writes them, never from the text
    given), else the text as it is."""
    text = sys.stdin.read() if cfg.prompt == "-" else cfg.prompt
    if not text:
        raise UsageError("the prompt is empty")
    fmt = None
    if not cfg.ignore_chat_template and (
        cfg.chat_template or cfg.system or getattr(tokenizer, "chat_template", None)
    ):
        fmt = chat_format(tokenizer, cfg.chat_template)
    if fmt is None:
        return text, []
    messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
    return encode_chat(tokenizer, fmt, messages + [{"role": "user", "content": text}]), fmt.stops


def _one_answer(cfg: GenerateConfig, model, tokenizer) -> None:
    prompt, stops = _prompt(cfg, tokenizer)
    if cfg.stop:
        stops = [*stops, cfg.stop]
    last = None
    for last in stream_generate(
        model, tokenizer, prompt, stop=stops, seed=cfg.seed, **_sampling(cfg)
    ):
        print(last.text, end="", flush=True)
    print()
    if last is not None and last.finish_reason == "cache":
        print(CACHE_FULL.format(cfg.max_cache or default_max_cache(model)), file=sys.stderr)
    if cfg.verbose and last is not None:
        print(_stats(last), file=sys.stderr)


CACHE_FULL = (
    "[stopped: the attention blocks' KV cache is full (--max-cache {}) and --no-window "
    "keeps no sliding window]"
)


def _stats(r) -> str:
    return (
        f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tokens/s; answer: "
        f"{r.generation_tokens} tokens, {r.generation_tps:.1f} tokens/s; peak memory "
        f"{r.peak_memory:.2f} GB"
    )


HELP = """commands:
  /reset         start a new conversation (the system prompt stays)
  /save FILE     save the whole conversation (state and transcript) to FILE.safetensors
  /load FILE     continue a saved conversation
  /system TEXT   set the system prompt (no TEXT: none) and start a new conversation
  /temp F        set the sampling temperature (0: greedy)
  /help          this list
  /quit          leave (Ctrl-D too); Ctrl-C stops an answer"""


class _Screen:
    """What the chat prints: answers as they come, dim lines for statistics on a terminal."""

    def __init__(self, out=sys.stdout):
        self.out = out
        self.tty = out.isatty()

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def dim(self, text: str) -> None:
        self.say(f"\033[2m{text}\033[0m" if self.tty else text)


def _command(chat: Chat, line: str, screen: _Screen) -> bool:
    """Run a slash command; False to quit."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    try:
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            screen.say(HELP)
        elif name == "/reset":
            chat.reset()
            screen.say("new conversation")
        elif name == "/system":
            chat.reset(system=arg or None)
            screen.say(f"system prompt {'set' if arg else 'cleared'}; new conversation")
        elif name == "/temp":
            try:
                temp = float(arg)
            except ValueError:
                raise UsageError(f"/temp needs a number, got {arg!r}") from None
            if not temp >= 0:
                raise UsageError("/temp must not be negative")
            chat.options["temp"] = temp
            screen.say(f"temperature {temp:g}")
        elif name in ("/save", "/load"):
            if not arg:
                raise UsageError(f"{name} needs a file name")
            path = arg if arg.endswith(".safetensors") else arg + ".safetensors"
            if name == "/save":
                chat.save(path)
                screen.say(f"saved {len(chat.session.tokens)} tokens to {path}")
            else:
                chat.load(path)
                turns = sum(m["role"] == "user" for m in chat.messages)
                screen.say(f"loaded {path}: {turns} turns, {len(chat.session.tokens)} tokens")
        else:
            raise UsageError(f"unknown command {name} (/help lists them)")
    except UserError as e:  # a bad command or file: the user's to fix, the chat goes on
        screen.say(f"error: {e}")
    return True


def _answer(chat: Chat, line: str, screen: _Screen) -> None:
    last = None
    responses = chat.ask(line)
    try:
        for last in responses:
            screen.say(last.text, end="")
    except KeyboardInterrupt as e:
        responses.close()
        if cli.signal_of(e) != signal.SIGINT:  # SIGTERM ends the chat, not the answer
            raise
        screen.say("")
        screen.dim("[stopped]")
        return
    screen.say("")
    if last is not None and last.finish_reason == "cache":
        screen.dim(CACHE_FULL.format(chat.session.max_cache))
    if last is not None:
        reused = f", {chat.reused} held" if chat.reused else ""
        screen.dim(
            f"[{last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s; prompt "
            f"{chat.prefilled} new tokens{reused}, {last.prompt_tps:.1f} tokens/s]"
        )


def _chat_loop(cfg: GenerateConfig, model, tokenizer) -> None:
    try:
        import readline  # noqa: F401 (line editing and history for input())
    except ImportError:
        pass
    options = _sampling(cfg)
    gen = {k: options.pop(k) for k in ("max_cache", "window")}
    if cfg.stop:
        options["stop"] = [cfg.stop]
    chat = Chat(model, tokenizer, template=cfg.chat_template, system=cfg.system, **gen, **options)
    if cfg.seed is not None:
        mx.random.seed(cfg.seed)
    screen = _Screen()
    screen.say(
        f"chat with {cfg.model} ({chat.format.name} format). /help for commands, Ctrl-D to quit."
    )
    while True:
        try:
            line = input("> ")
        except EOFError:
            screen.say("")
            return
        except KeyboardInterrupt as e:
            if cli.signal_of(e) != signal.SIGINT:
                raise
            screen.say("")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            try:
                if not _command(chat, line, screen):
                    return
            except KeyboardInterrupt as e:  # a slow /save or /load: the chat goes on
                if cli.signal_of(e) != signal.SIGINT:
                    raise
                screen.say("")
                screen.dim("[stopped]")
            continue
        try:
            _answer(chat, line, screen)
        except UserError as e:  # text the tokenizer cannot encode, a cache that is full
            screen.say(f"error: {e}")


def main(argv: list[str] | None = None) -> None:
    cli.run(
        PROG,
        lambda: _main(settings.load(GenerateConfig, argv, PROG)),
        kept="the answer so far is above",
    )


def _main(cfg: GenerateConfig) -> None:
    """The command's work. Its user errors are UserErrors (UsageError here; CheckpointError,
    AdapterError, GenerationError below), which ``cli.run`` turns into one line; any other
    exception, an MLX shape error (a ValueError) too, is a bug and keeps its traceback."""
    configure_and_prepare()  # kernels checked before anything runs
    model, tokenizer = _load(cfg)
    if tokenizer is None:
        raise UsageError(f"--model {cfg.model}: no tokenizer found beside it")
    if cfg.chat_template is not None:
        chat_format(tokenizer, cfg.chat_template)  # a bad name or file: before any work
    if cfg.prompt is not None:
        _one_answer(cfg, model, tokenizer)
    elif cfg.chat or sys.stdin.isatty():
        _chat_loop(cfg, model, tokenizer)
    else:
        raise UsageError(
            "no --prompt and standard input is not a terminal: give --prompt TEXT, "
            "--prompt - (read standard input) or --chat"
        )


class _CallableModule(types.ModuleType):
    """``mlx_rwkvx.generate(...)`` calls the function, also once this module has taken the
    package attribute's name.

    Why a module class: the name is both the function (``mlx_rwkvx.generate(model, tok, p)``)
    and this command (``python -m mlx_rwkvx.generate``). After ``import mlx_rwkvx.generate``
    the import system itself sets the package attribute to this module, after the module ran,
    so nothing the module does can leave the function there; the package must not import the
    command either (``python -m`` would then warn, as it does for mlx-lm's layout). So the
    module, once it holds the name, calls the function."""

    def __call__(self, *args, **kwargs):
        return generation.generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
