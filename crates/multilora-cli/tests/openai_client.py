"""Talks to a running `multilora serve` with the official `openai` Python client.

Usage: openai_client.py BASE_URL API_KEY {with-template|no-template}
Prints one line starting with OK when every check holds; any failure raises (exit status 1).
"""
import sys

import openai

base_url, api_key, mode = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=60)

if mode == "no-template":
    try:
        client.chat.completions.create(model="qv_r8", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        raise AssertionError("chat without a template must fail")
    except openai.BadRequestError as e:
        assert e.status_code == 400, e
        assert "chat template" in str(e), e
    print("OK no-template: chat refused with a clear 400")
    sys.exit(0)

ids = sorted(m.id for m in client.models.list().data)
assert ids == sorted(["base", "qv_r8", "all_r16"]), ids

c = client.completions.create(
    model="qv_r8", prompt="The quick brown fox", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
)
assert c.object == "text_completion", c
assert c.choices[0].finish_reason == "length", c
assert c.usage.completion_tokens == 5, c.usage
assert isinstance(c.choices[0].text, str)

stream = client.chat.completions.create(
    model="all_r16",
    messages=[{"role": "user", "content": "Hello"}],
    max_tokens=6,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"ignore_eos": True},
)
pieces, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
assert finish == "length", finish
assert usage is not None and usage.completion_tokens == 6, usage
whole = client.chat.completions.create(
    model="all_r16",
    messages=[{"role": "user", "content": "Hello"}],
    max_tokens=6,
    temperature=0,
    extra_body={"ignore_eos": True},
)
assert whole.choices[0].message.content == "".join(pieces), (whole, pieces)

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    raise AssertionError("an unknown model must fail")
except openai.NotFoundError as e:
    assert e.status_code == 404, e

print(f"OK with-template: models {ids}, completion {c.choices[0].text!r}, streamed chat {''.join(pieces)!r}")
