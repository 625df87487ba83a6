"""Structured outputs and tools through the official `openai` Python client, against a running
`multilora serve` of SmolLM2 with three adapters: every reply is checked by `jsonschema`, `re`
and `json`, never by the server's own code.

Usage: structured_client.py BASE_URL API_KEY BASE_MODEL ADAPTER...
Prints lines starting with OK when every check holds; any failure raises (exit status 1).
"""
import concurrent.futures as cf
import json
import random
import re
import sys
import time

import jsonschema
import openai

base_url, api_key, models = sys.argv[1], sys.argv[2], sys.argv[3:]
client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=300)
SUBJECTS = ["a cat", "a city", "a book", "a planet", "a recipe", "a car", "a song", "a tree"]


def schema_for(i: int) -> dict:
    """Schema `i` of 200, of varied shape: nested objects, arrays with item bounds, enums,
    patterns, optional fields, `$ref` into `$defs`; every string and array bounded."""
    rng = random.Random(i)
    name = {"type": "string", "minLength": 1, "maxLength": rng.choice([8, 16, 24])}
    count = {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 1000])}
    color = {"enum": rng.sample(["red", "green", "blue", "black", "white"], 3)}
    code = {"type": "string", "pattern": rng.choice(["^[A-Z]{2}-[0-9]{3}$", "^[a-z]+$", "^[0-9]{4}$"]), "maxLength": 12}
    tags = {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(2, 4)}
    flag = {"type": "boolean"}
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                              "y": {"type": "integer", "minimum": -50, "maximum": 50}},
             "required": ["x", "y"], "additionalProperties": False}
    kinds = [("name", name), ("count", count), ("color", color), ("code", code), ("tags", tags), ("flag", flag),
             ("where", {"$ref": "#/$defs/point"}),
             ("points", {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2}),
             ("owner", {"type": "object", "properties": {"name": name, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 120}},
                        "required": ["name"], "additionalProperties": False})]
    chosen = rng.sample(kinds, rng.randint(2, 5))
    props = {k: v for k, v in chosen}
    required = [k for k, _ in chosen if rng.random() < 0.7] or [chosen[0][0]]
    schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if any("$ref" in json.dumps(v) for v in props.values()):
        schema["$defs"] = {"point": point}
    return schema


def json_request(i: int):
    schema = schema_for(i)
    model = models[i % len(models)]
    subject = SUBJECTS[i % len(SUBJECTS)]
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Describe {subject} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        max_tokens=400,
        temperature=[0.0, 0.7, 1.0][i % 3],
        seed=i,
    )
    c = r.choices[0]
    # `length`: the budget ran out and the engine closed the JSON (it still validates).
    assert c.finish_reason in ("stop", "length"), (i, c.finish_reason, c.message.content)
    jsonschema.validate(json.loads(c.message.content), schema)
    return r.usage.completion_tokens, c.finish_reason


def run_all(fn, n, workers):
    with cf.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, range(n)))


t = time.time()
done = run_all(json_request, 200, 32)
closed = sum(1 for _, f in done if f == "length")
print(f"OK json_schema: 200 of 200 replies over {len(models)} models validate ({sum(n for n, _ in done)} tokens, "
      f"{closed} closed at max_tokens, {time.time() - t:.1f} s)")


def json_object(i: int):
    r = client.chat.completions.create(
        model=models[i % len(models)],
        messages=[{"role": "user", "content": f"Give {SUBJECTS[i % len(SUBJECTS)]} as a short JSON object."}],
        response_format={"type": "json_object"}, max_tokens=160, temperature=0.7, seed=i)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length"), (i, c.message.content)
    assert isinstance(json.loads(c.message.content), dict), c.message.content
    return c.finish_reason


ends = run_all(json_object, 24, 24)
print(f"OK json_object: 24 of 24 replies parse as objects ({ends.count('length')} closed at max_tokens)")

LABELS = ["positive", "negative", "neutral"]
PLATE = r"[A-Z]{3}-[0-9]{2,4}"


def choice_and_regex(i: int):
    model = models[i % len(models)]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Label: I love it."}],
                                       extra_body={"guided_choice": LABELS}, temperature=1.0, seed=i, max_tokens=20)
    assert r.choices[0].message.content in LABELS, r.choices[0].message.content
    c = client.completions.create(model=model, prompt="A licence plate:", extra_body={"guided_regex": PLATE},
                                  temperature=1.0, seed=i, max_tokens=20)
    assert re.fullmatch(PLATE, c.choices[0].text), c.choices[0].text


run_all(choice_and_regex, 24, 24)
print("OK guided_choice and guided_regex: 24 of 24 each")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Adds two numbers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                     "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                    "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def tool_request(i: int):
    choice = "required" if i % 2 == 0 else {"type": "function", "function": {"name": ["get_weather", "add"][i % 4 // 2]}}
    r = client.chat.completions.create(
        model=models[i % len(models)],
        messages=[{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}],
        tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=[0.0, 1.0][i % 2], seed=i)
    calls = r.choices[0].message.tool_calls
    assert calls, r
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        if isinstance(choice, dict):
            assert call.function.name == choice["function"]["name"], call
    return len(calls)


calls = run_all(tool_request, 40, 20)
print(f"OK tools: 40 of 40 replies (required and named) carry {sum(calls)} calls whose arguments validate")

# Unconstrained rows beside constrained ones: the same greedy text as without them.
plain = dict(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24, temperature=0)
alone = [client.chat.completions.create(model=m, **plain).choices[0].message.content for m in models]
with cf.ThreadPoolExecutor(16) as pool:
    busy = [pool.submit(json_request, i) for i in range(12)]
    beside = [pool.submit(lambda m: client.chat.completions.create(model=m, **plain).choices[0].message.content, m)
              for m in models]
    assert [f.result() for f in beside] == alone
    for f in busy:
        f.result()
print("OK unconstrained rows in a constrained batch give the text they give alone")
