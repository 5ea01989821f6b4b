"""A chat: ``Chat`` carries a conversation's state from turn to turn, so that each turn
prefills only its new tokens, and saves it to one file and loads it back (``is_conversation``
tells such a file); ``chat_format`` renders a conversation (the tokenizer's template, RWKV's
``User:/Assistant:``, ChatML or a Jinja file), and ``encode_chat`` encodes it with special
tokens only where the template wrote them, never from a message's text."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from mlx_rwkvx._mlx_lm import GenerationResponse
from mlx_rwkvx.adapters.fingerprint import model_identity
from mlx_rwkvx.errors import CheckpointError, GenerationError
from mlx_rwkvx.generation.stream import Session, encode_prompt, stream_generate
from mlx_rwkvx.io.states import read_header, read_state, save_state
from mlx_rwkvx.io.targets import reason
from mlx_rwkvx.io.tokenizers import rwkv_chat_text
from mlx_rwkvx.models.model import Model

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
    strings that end an answer, a name (for saved conversations), and ``tools``: whether the
    template writes a list of tools (``render(..., tools=[...])``, OpenAI's function
    schemas) into the prompt."""

    name: str
    render: Callable[..., str]
    stops: list[str] = field(default_factory=list)
    tools: bool = False

    def apply(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """``render``, with a template's own refusal of the messages (Jinja's
        ``raise_exception``) as a GenerationError; ``tools`` for a template that takes them
        (GenerationError for one that does not)."""
        from jinja2 import TemplateError

        if tools and not self.tools:
            raise GenerationError(f"chat template {self.name}: it takes no tools")
        try:
            if tools:
                return self.render(messages, add_generation_prompt, tools=tools)
            return self.render(messages, add_generation_prompt)
        except TemplateError as e:
            raise GenerationError(f"chat template {self.name}: {e}") from e


def _takes_tools(template: str | None) -> bool:
    return "tools" in (template or "")  # a template that never names them cannot write them


def _jinja(template: str) -> Callable[..., str]:
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(messages, add_generation_prompt, tools=None):
        rendered, _ = render_jinja_template(
            [messages],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )
        return rendered[0]

    return render


def chat_format(tokenizer, template: str | None = None) -> ChatFormat:
    """The conversation format: ``template`` None takes the tokenizer's own chat template
    (through transformers' ``apply_chat_template``) where it has one, else RWKV's
    ``User: ...\\n\\nAssistant: ...`` convention; or a name (``rwkv``, ``chatml``) or the path
    of a Jinja template file. Raises GenerationError for an unknown name, an unreadable file
    or one that does not render the messages."""
    if template is None:
        if getattr(tokenizer, "chat_template", None):

            def render(messages, add_generation_prompt, **kw):
                return tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
                )

            own = tokenizer.chat_template
            return ChatFormat("tokenizer", render, _im_end_stop(tokenizer, own), _takes_tools(own))
        template = "rwkv"
    if template == "rwkv":
        return ChatFormat("rwkv", rwkv_chat_text, [RWKV_STOP])
    if template == "chatml":
        return ChatFormat("chatml", _jinja(CHATML), _im_end_stop(tokenizer, force=True))
    if not os.path.isfile(template):
        raise GenerationError(
            f"chat template {template!r}: neither one of {list(TEMPLATE_NAMES)} nor a file"
        )
    try:
        with open(template, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"chat template {template}: cannot read it ({e})") from e
    render = _jinja(text)
    probe = "<probe: the user's words>"
    try:
        rendered = render([{"role": "user", "content": probe}], True)
    except Exception as e:  # jinja2's own errors: a template that does not render
        raise GenerationError(f"chat template {template}: does not render ({e})") from e
    if probe not in rendered:  # a file that is not a template renders as itself
        raise GenerationError(
            f"chat template {template}: does not render the messages (their text is not in "
            "what it writes): not a chat template?"
        )
    return ChatFormat(
        os.path.abspath(template), render, _im_end_stop(tokenizer, text), _takes_tools(text)
    )


def _im_end_stop(tokenizer, template: str | None = None, force: bool = False) -> list[str]:
    """ChatML's turns end with ``<|im_end|>``: a stop string for a template that writes it
    (or ``force``), unless it is one token and one of the tokenizer's end-of-text ids (a Qwen2
    base tokenizer ends texts with ``<|endoftext|>``, not ``<|im_end|>``)."""
    if not force and "<|im_end|>" not in (template or ""):
        return []
    ids = tokenizer.encode("<|im_end|>") if tokenizer is not None else []
    eos = getattr(tokenizer, "eos_token_ids", set()) or set()
    return [] if len(ids) == 1 and ids[0] in eos else ["<|im_end|>"]


# ----- encoding a conversation -----------------------------------------------------------------

_SLOT = "\ue000{}\ue001"  # private-use characters around a message's index: where its text goes
_SLOTS = re.compile("\ue000(\\d+)\ue001")


@dataclass
class ChatText:
    """A rendered conversation: its ``text``, and the spans of it (start, end) that are the text
    of a message holding special-token text (a user writing ``<|im_end|>``), which
    ``encode_chat_text`` spells as text."""

    text: str
    literal: list[tuple[int, int]] = field(default_factory=list)


def _holds_special_tokens(tokenizer, text) -> bool:
    special = getattr(tokenizer, "special_token_ids", None)
    return bool(
        special and text and isinstance(text, str) and special & set(encode_prompt(tokenizer, text))
    )


def render_chat(
    tokenizer,
    fmt: ChatFormat,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list | None = None,
) -> ChatText:
    """``fmt.apply(messages, ...)``, and where the messages' text lies in it when some of it
    would encode to a special token. Found by rendering again with each such text replaced by
    a slot, and kept only if filling the slots gives back the same text; where it does not (a
    template that rewrites the text, or reads it), GenerationError: no way to tell the
    template's special tokens from the message's."""
    text = fmt.apply(messages, add_generation_prompt, tools=tools)
    hostile = {
        i for i, m in enumerate(messages) if _holds_special_tokens(tokenizer, m.get("content"))
    }
    if not hostile:
        return ChatText(text)
    slotted = [
        {**m, "content": _SLOT.format(i)} if i in hostile else m for i, m in enumerate(messages)
    ]
    try:
        pieces = _SLOTS.split(fmt.apply(slotted, add_generation_prompt, tools=tools))
    except GenerationError:
        pieces = []
    filled, literal = [], []
    for k, piece in enumerate(pieces):
        if k % 2 and int(piece) in hostile:
            start, piece = sum(map(len, filled)), messages[int(piece)]["content"]
            literal.append((start, start + len(piece)))
        elif k % 2:  # a message's own text that looks like a slot
            piece = _SLOT.format(piece)
        filled.append(piece)
    if "".join(filled) != text:
        raise GenerationError(
            f"chat template {fmt.name}: a message holds special-token text (such as "
            "<|im_end|>) and the template rewrites or reads the message's text, so its special "
            "tokens cannot be told from the message's: take the special-token text out"
        )
    return ChatText(text, literal)


def encode_chat_text(tokenizer, chat: ChatText, start: int = 0) -> list[int]:
    """The token ids of ``chat.text[start:]``: the ``literal`` spans through the tokenizer's
    ``encode_plain`` (special-token text as text), the rest as one text each (the template's
    special tokens as special tokens, and the tokens of any other message as whole-text encoding
    gives them, as before)."""
    ids, at = [], start
    for s, e in chat.literal:
        s, e = max(s, start), max(e, start)
        if s == e:
            continue
        if at < s:
            ids += encode_prompt(tokenizer, chat.text[at:s])
        ids += tokenizer.encode_plain(chat.text[s:e])
        at = e
    if at < len(chat.text):
        ids += encode_prompt(tokenizer, chat.text[at:])
    return ids


def encode_chat(
    tokenizer,
    fmt: ChatFormat,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list | None = None,
) -> list[int]:
    """The prompt of a conversation as token ids: ``fmt`` renders it, and special tokens come
    only from the template, never from a message's text (a user's ``<|im_end|>\\n<|im_start|>
    system`` stays text: no role spoofing). Raises GenerationError as ``render_chat``."""
    chat = render_chat(tokenizer, fmt, messages, add_generation_prompt, tools)
    return encode_chat_text(tokenizer, chat)


# ----- the chat --------------------------------------------------------------------------------


def is_conversation(path: str) -> bool:
    """Whether ``path`` is a conversation ``Chat.save`` wrote (its header says so)."""
    try:
        return read_header(path).kind == "conversation"
    except (OSError, CheckpointError):
        return False


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

    def _continue(self, chat: ChatText) -> list[int]:
        """Bring the session to the latest held state whose text ``chat`` continues (after
        the previous answer, else before it, else the start); the ids still to feed."""
        held = [self.session.snapshot()]
        if self._before_answer is not None:
            held.append(self._before_answer)
        for snap in held:
            done = self._fed_text(snap[0])
            if snap[0] and chat.text.startswith(done) and len(chat.text) > len(done):
                ids = encode_chat_text(self.tokenizer, chat, len(done))  # first: it may refuse
                self.session.restore(snap)
                self.reused = len(snap[0])
                return ids
        ids = encode_chat_text(self.tokenizer, chat)
        self.session.reset()
        self.reused = 0
        return ids

    def ask(self, user: str, **options) -> Iterator[GenerationResponse]:
        """Stream the answer to ``user``; the conversation then holds both (an answer stopped
        early, by Ctrl-C or ``close()``, is kept as far as it came)."""
        if not isinstance(user, str):
            raise TypeError(f"chat: the message must be a str, got {type(user).__name__}")
        chat = render_chat(self.tokenizer, self.format, self._conversation(user))
        opts = {**self.options, **options}
        stops = list(self.format.stops) + list(opts.pop("stop", ()))
        ids = self._continue(chat)
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
        """The model a saved conversation belongs to (``model_identity``)."""
        return model_identity(self.model)

    def save(self, path: str) -> None:
        """The whole conversation in one saved-state file (``io/states.py``), written
        atomically: the tokens fed and the state after them, the state before the last answer
        (from which the next turn continues when the answer's rendering differs), messages,
        system prompt and chat format. Replaces a saved state, never another file."""
        path = os.fspath(path)
        if not path.endswith(".safetensors"):
            raise CheckpointError(f"{path}: a conversation is saved as a .safetensors file")
        tokens, state = self.session.snapshot()
        meta = {
            "kind": "conversation",
            "messages": json.dumps(self.messages),
            "system": json.dumps(self.system),
            "template": self.format.name,
        }
        before = {"before": self._before_answer} if self._before_answer is not None else None
        save_state(path, tokens, state, self.identity(), meta=meta, others=before)

    def load(self, path: str) -> None:
        """Continue the conversation saved in ``path`` (by this or another process; also a
        file of the format before ``STATE_FORMAT``). Raises CheckpointError (a ValueError)
        naming the file and the problem for one that is not a conversation, belongs to another
        model or adapter, or fails ``read_state``'s checks; the chat is unchanged then."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such file")
        what = "a saved conversation"
        try:
            saved = read_state(path, self.model, self.identity(), what=what)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read it ({reason(e)})") from e
        meta = saved.meta
        if meta.get("kind") != "conversation":
            raise CheckpointError(
                f"{path}: not {what} (a saved state of another kind: "
                f"{meta.get('kind') or 'unknown'})"
            )
        if meta.get("template") != self.format.name:
            raise CheckpointError(
                f"{path}: the conversation was saved in the {meta.get('template')!r} chat "
                f"format, this chat uses {self.format.name!r} (--chat-template)"
            )
        try:
            messages, system = json.loads(meta["messages"]), json.loads(meta["system"])
            if not isinstance(messages, list):
                raise ValueError("no messages")
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
        now, before = (saved.tokens, saved.state), saved.others.get("before")
        self.messages, self.system = messages, system
        self.session.restore(now)
        self._before_answer = before
