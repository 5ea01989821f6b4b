"""Generation: ``stream_generate`` / ``generate`` of one sequence over a model's explicit state
(``stream.py``, on mlx-lm's machinery), and ``Chat``, a conversation carried from turn to turn
and saved to one file (``chat.py``)."""

from mlx_rwkvx.errors import GenerationError
from mlx_rwkvx.generation.chat import (
    TEMPLATE_NAMES,
    Chat,
    ChatFormat,
    chat_format,
    encode_chat,
    is_conversation,
)
from mlx_rwkvx.generation.stream import (
    DEFAULT_MAX_CACHE,
    DEFAULT_PREFILL_STEP,
    GenerationResponse,
    Session,
    generate,
    stream_generate,
)
from mlx_rwkvx.io.states import STATE_FORMAT

__all__ = [
    "DEFAULT_MAX_CACHE",
    "DEFAULT_PREFILL_STEP",
    "STATE_FORMAT",
    "TEMPLATE_NAMES",
    "Chat",
    "ChatFormat",
    "GenerationError",
    "GenerationResponse",
    "Session",
    "chat_format",
    "encode_chat",
    "generate",
    "is_conversation",
    "stream_generate",
]
