"""Talks to a running `multilora serve` with the official `openai` and `anthropic` Python clients
through the APIs agent tools speak: OpenAI's Responses (`responses.create`, `responses.stream`)
and Anthropic's Messages (`messages.create`, `messages.stream`, `messages.count_tokens`), each
against chat completions' greedy answer to the same conversation; then `/tokenize` and
`/detokenize`.

Usage: agent_clients.py BASE_URL API_KEY MODEL
Prints one line starting with OK when every check holds; any failure raises (exit status 1).
"""
import json
import sys
import urllib.request

import anthropic
import openai

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
oai = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)
# Anthropic's client appends /v1/messages itself and sends the key as `x-api-key`.
ant = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)

system = "You are a helpful assistant."
question = "What is the capital of France? Answer in one short sentence."
max_tokens = 40
greedy = {"temperature": 0.0}

chat = oai.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    max_tokens=max_tokens,
    **greedy,
)
want = chat.choices[0].message.content
prompt_tokens = chat.usage.prompt_tokens
assert want, chat

# OpenAI Responses.
r = oai.responses.create(model=model, instructions=system, input=question, max_output_tokens=max_tokens, **greedy)
assert r.output_text == want, (r.output_text, want)
assert r.usage.input_tokens == prompt_tokens, (r.usage, prompt_tokens)
with oai.responses.stream(
    model=model, instructions=system, input=question, max_output_tokens=max_tokens, **greedy
) as stream:
    deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    if chat.choices[0].finish_reason == "length":
        streamed = stream.current_snapshot.output[0].content[0].text
    else:
        streamed = stream.get_final_response().output_text
assert "".join(deltas) == want and streamed == want, (deltas, streamed, want)

# Anthropic Messages: the sampling fields the 2026 client has no arguments for go in the body.
body = {"top_k": 1}
m = ant.messages.create(
    model=model,
    system=system,
    max_tokens=max_tokens,
    messages=[{"role": "user", "content": question}],
    extra_body={**greedy, **body},
)
assert m.content[0].text == want, (m.content, want)
assert m.usage.input_tokens == prompt_tokens, (m.usage, prompt_tokens)
assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"), m.stop_reason
with ant.messages.stream(
    model=model,
    system=system,
    max_tokens=max_tokens,
    messages=[{"role": "user", "content": question}],
    extra_body={**greedy, **body},
) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
assert text == want and final.content[0].text == want, (text, final, want)
assert final.usage.output_tokens == chat.usage.completion_tokens, (final.usage, chat.usage)
count = ant.messages.count_tokens(model=model, system=system, messages=[{"role": "user", "content": question}])
assert count.input_tokens == prompt_tokens, (count, prompt_tokens)
try:
    ant.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    raise AssertionError("an unknown model must fail")
except anthropic.NotFoundError as e:
    assert e.status_code == 404 and e.body["error"]["type"] == "not_found_error", e.body


def post(route, payload):
    req = urllib.request.Request(
        base_url + route,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


tok = post("/tokenize", {"model": model, "prompt": question, "add_special_tokens": False})
assert post("/detokenize", {"model": model, "tokens": tok["tokens"]})["prompt"] == question, tok
counted = post("/tokenize", {"model": model, "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": question}]})
assert counted["count"] == prompt_tokens, (counted, prompt_tokens)

print(f"OK agent clients on {model}: responses, messages and chat all answer {want!r} ({prompt_tokens} prompt tokens)")
