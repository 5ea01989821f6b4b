"""Tool calls in a model's answer, in its chat template's own format, through mlx-lm's tool
parsers (``mlx_lm.tool_parsers``: Qwen2's ``<tool_call>`` JSON, Mistral's ``[TOOL_CALLS]``,
pythonic calls, ...), chosen from the template as mlx-lm chooses it. What is ours: cutting the
answer into its text and its calls, also as it streams (text that may begin a call waits), and
OpenAI's ``tool_calls`` entries."""

from __future__ import annotations

import json
import uuid
import warnings


class ToolCalls:
    """The tool-call format of a tokenizer's chat template (``start`` and ``end`` markers and
    mlx-lm's parser), or None from ``of`` when the template writes none."""

    def __init__(self, kind: str):
        from mlx_rwkvx._mlx_lm import tool_parser

        module = tool_parser(kind)
        self.kind = kind
        self.start, self.end = module.tool_call_start, module.tool_call_end
        self._parse = module.parse_tool_call

    @classmethod
    def of(cls, tokenizer) -> ToolCalls | None:
        if not getattr(tokenizer, "chat_template", None):
            return None
        # mlx-lm's own inference from the template and vocabulary: what its server uses
        from mlx_rwkvx._mlx_lm import infer_tool_parser

        kind = infer_tool_parser(tokenizer)
        return cls(kind) if kind else None

    def split(self, text: str, tools: list | None) -> tuple[str, list[dict]]:
        """(the answer's text outside the calls, its calls as OpenAI's ``tool_calls``). A call
        that does not parse (cut off by ``max_tokens``) stays in the text."""
        content, calls, at = [], [], 0
        while True:
            begin = text.find(self.start, at)
            if begin < 0:
                content.append(text[at:])
                break
            content.append(text[at:begin])
            stop = text.find(self.end, begin + len(self.start)) if self.end else -1
            body_end = stop if stop >= 0 else len(text)
            after = body_end + len(self.end) if stop >= 0 else len(text)
            body = text[begin + len(self.start) : body_end]
            parsed = self._parsed(body, tools)
            if parsed is None:
                content.append(text[begin:after])
            else:
                calls.extend(parsed)
            at = after
        return "".join(content).strip() if calls else "".join(content), calls

    def _parsed(self, body: str, tools) -> list[dict] | None:
        try:
            found = self._parse(body, tools)
        except (ValueError, KeyError, TypeError, IndexError) as e:  # json's errors are ValueErrors
            warnings.warn(f"a tool call that does not parse ({e})", stacklevel=3)
            return None
        out = []
        for call in found if isinstance(found, list) else [found]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            arguments = call.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            out.append(
                {
                    "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": arguments},
                }
            )
        return out

    def held(self, text: str) -> int:
        """Where the text that can be shown while streaming ends: before a call's start marker,
        or before a tail that may still become one."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)
