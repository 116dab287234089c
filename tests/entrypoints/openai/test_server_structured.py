"""Output constraints through the server: OpenAI's `response_format` (with the openai client's `parse`),
vLLM's `structured_outputs` and `guided_*` fields; every constrained output validates, and a bad or doubled
constraint is a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from remote_server import CHAT_TEMPLATE, RemoteServer, assert_error
from stories260k import PROMPT

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


def complete(server: RemoteServer, **fields: object) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 80, "temperature": 0.8, "seed": 1, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_format_json_schema_validates(server: RemoteServer, seed: int) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    response = complete(server, response_format=fmt, seed=seed, max_tokens=300)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_vllm_constraint_fields(server: RemoteServer) -> None:
    choice = complete(server, response_format={"type": "json_object"}, max_tokens=200).json()["choices"][0]
    # Free text in a string may run to max_tokens; a finished object parses.
    assert choice["text"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    text = complete(server, guided_regex=r"[a-z]{3,8} [0-9]{2}").json()["choices"][0]["text"]
    assert re.fullmatch(r"[a-z]{3,8} [0-9]{2}", text)
    for fields in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        assert complete(server, **fields).json()["choices"][0]["text"] in ("yes", "no")
    item = {"type": "integer", "minimum": -100, "maximum": 100}
    schema = {"type": "array", "items": item, "minItems": 1, "maxItems": 4}
    compact = {"json": schema, "disable_any_whitespace": True}
    choice = complete(server, structured_outputs=compact, max_tokens=200).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)
    # guided_json allows whitespace between tokens (vLLM's default): valid JSON wherever it finished.
    choice = complete(server, guided_json=schema, max_tokens=200).json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), schema)
    grammar = 'root ::= "(" [0-9] [0-9]? ("+" [0-9] [0-9]?)? ")"'
    text = complete(server, guided_grammar=grammar).json()["choices"][0]["text"]
    assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})?\)", text)


def test_openai_client_parse_gets_a_parsed_object(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    completion = client.chat.completions.parse(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Who is there?"}],
        response_format=Person,
        max_tokens=300,
        temperature=0.8,
        seed=3,
        extra_body={"chat_template": CHAT_TEMPLATE},
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
        ({"guided_regex": "[unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server: RemoteServer, fields: dict, param: str) -> None:
    assert_error(complete(server, **fields), 400, param)
