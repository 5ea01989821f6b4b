"""``response_format``: answers of a random model held to 24 JSON schemas (nested objects,
arrays, enums, numbers, required and optional fields, references, unions; bounded by
``maxLength``, enums, ``maxItems`` and closed objects, since a random model rarely closes a
free string) parse
and validate, streamed and not, on a byte-level BPE (its tokenizer.json) and on the byte
tokenizer (a vocabulary of byte strings, as RWKV World's); a ``finish_reason`` of ``length``
fails. A schema llguidance cannot compile is a 400."""

from __future__ import annotations

import json

import mlx_rwkvx

import pytest
from helpers import chatml_tokenizer, tiny_model
from helpers.parity import import_parity_extra
from helpers.serving import serving

import_parity_extra(("fastapi", "uvicorn", "llguidance"), extra="server")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WORD = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    },
    {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["x"],
    },
    {
        "type": "object",
        "properties": {"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["points"],
    },
    {
        "type": "object",
        "properties": {"a": WORD, "b": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
        "required": ["code"],
    },
    {"type": "object", "properties": {"kind": {"const": "fixed"}}, "required": ["kind"]},
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "boolean"}, {"enum": [1, 2, 3]}]}},
        "required": ["v"],
    },
    {"type": "object", "properties": {"nothing": {"type": "null"}}, "required": ["nothing"]},
    {
        "type": "object",
        "properties": {"maybe": {"type": ["string", "null"], "maxLength": 4}},
        "required": ["maybe"],
    },
    {
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}},
            }
        },
        "required": ["grid"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9},
                    "role": {"enum": ["admin", "guest"]},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": WORD,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "role", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"sku": WORD, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"$ref": "#/$defs/item"},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"level": {"enum": [1, 2.5, 10]}}, "required": ["level"]},
    {
        "type": "object",
        "properties": {
            "flag": {"type": "boolean"},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "label": WORD,
        },
        "required": ["flag", "count", "label"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 4},
    {"enum": ["yes", "no"]},
    {
        "type": "object",
        "properties": {
            "answer": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"ok": {"const": True}},
                        "required": ["ok"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"error": WORD},
                        "required": ["error"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["answer"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "maxItems": 3,
                "items": {"type": "number", "minimum": 0, "maximum": 1},
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"opt1": WORD, "opt2": {"type": "boolean"}, "req": {"enum": ["on", "off"]}},
        "required": ["req"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "meta": {
                "type": "object",
                "properties": {
                    "version": {"type": "integer", "minimum": 1, "maximum": 3},
                    "tags": {"type": "array", "items": WORD, "maxItems": 2},
                },
                "required": ["version"],
                "additionalProperties": False,
            }
        },
        "required": ["meta"],
        "additionalProperties": False,
    },
]
ASK = [{"role": "user", "content": "Hello, world!"}]


def _closed(schema):
    """Every object of ``schema`` without further properties (JSON Schema allows any by
    default: free names, which a random model rarely closes), as OpenAI's strict mode has it."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


SCHEMAS = [_closed(s) for s in SCHEMAS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("schema")
    tok = chatml_tokenizer(root / "tok")
    mlx_rwkvx.save(tiny_model("rwkv-x", seed=31, vocab_size=512), root / "bpe", tokenizer=tok)
    mlx_rwkvx.save(tiny_model("rfa", seed=32), root / "bytes")  # the byte tokenizer
    return root


def _format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_answers_keep_to_the_schema(models):
    assert len(SCHEMAS) >= 20
    for name, schemas in (("bpe", SCHEMAS), ("bytes", SCHEMAS[::4])):
        path = str(models / name)
        with serving("--model", path) as server:
            c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
            for i, schema in enumerate(schemas):
                jsonschema.Draft202012Validator.check_schema(schema)
                r = c.chat.completions.create(
                    model=path,
                    messages=ASK,
                    max_tokens=160,
                    temperature=1.0,
                    seed=i,
                    response_format=_format(schema),
                )
                choice = r.choices[0]
                assert choice.finish_reason == "stop", (name, i, choice)
                jsonschema.validate(json.loads(choice.message.content), schema)
            # streamed, and as a text completion
            stream = c.chat.completions.create(
                model=path,
                messages=ASK,
                max_tokens=160,
                temperature=1.0,
                seed=7,
                stream=True,
                response_format=_format(SCHEMAS[14]),
            )
            text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            jsonschema.validate(json.loads(text), SCHEMAS[14])
            fmt = {"response_format": _format(SCHEMAS[4])}
            t = c.completions.create(model=path, prompt="JSON:", max_tokens=160, extra_body=fmt)
            jsonschema.validate(json.loads(t.choices[0].text), SCHEMAS[4])
            obj = c.chat.completions.create(
                model=path, messages=ASK, max_tokens=300, response_format={"type": "json_object"}
            )
            if obj.choices[0].finish_reason == "stop":  # any object: it may not close
                assert isinstance(json.loads(obj.choices[0].message.content), dict)
            for bad in ({"type": "nonsense"}, {"type": "string", "pattern": "(("}):
                with pytest.raises(openai.BadRequestError, match="response_format"):
                    c.chat.completions.create(
                        model=path, messages=ASK, response_format=_format(bad)
                    )
            with pytest.raises(openai.BadRequestError, match="needs its schema"):
                c.chat.completions.create(
                    model=path,
                    messages=ASK,
                    response_format={"type": "json_schema", "json_schema": {"name": "x"}},
                )
