#!/usr/bin/env python3
"""The same streaming load through chat completions alone and mixed across the three APIs.

Starts `multilora serve` on a GGUF file with PEFT adapters, then, round after round, runs
--streams concurrent streamed requests of --tokens tokens each (`ignore_eos`, greedy) over the
adapters and the base model: once every request through `/v1/chat/completions`, once spread over
chat completions, `/v1/responses` and `/v1/messages` (a third each). Prints each load's tokens/s
(generated tokens over wall time) per round and the median ratio mixed / chat. Raw HTTP with one
thread a stream, so the client costs the same for every API.

    benches/peers/apis.py --multilora target/release/multilora --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --adapters tests/fixtures/smollm2/adapters --rounds 3
"""
import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

p = argparse.ArgumentParser()
p.add_argument("--multilora", required=True)
p.add_argument("--gguf", required=True)
p.add_argument("--adapters", required=True, help="a folder of PEFT adapter folders")
p.add_argument("--streams", type=int, default=16)
p.add_argument("--tokens", type=int, default=128)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--port", type=int, default=18931)
a = p.parse_args()

adapters = sorted(d for d in os.listdir(a.adapters) if os.path.isdir(os.path.join(a.adapters, d)))
mods = [f"{d}={os.path.join(a.adapters, d)}" for d in adapters]
server = subprocess.Popen(
    [a.multilora, "serve", "--model", a.gguf, "--port", str(a.port), "--served-model-name", "base",
     "--lora-modules", *mods],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
for _ in range(600):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=1)
        break
    except Exception:
        time.sleep(0.5)
models = ["base", *adapters]
question = "Write a long story about the sea."


def request(api, model):
    common = {"model": model, "temperature": 0, "stream": True, "ignore_eos": True}
    if api == "chat":
        return "/v1/chat/completions", {**common, "max_tokens": a.tokens,
                                        "messages": [{"role": "user", "content": question}]}
    if api == "responses":
        return "/v1/responses", {**common, "max_output_tokens": a.tokens, "input": question}
    return "/v1/messages", {**common, "max_tokens": a.tokens, "messages": [{"role": "user", "content": question}]}


def delta_event(api, data):
    if api == "chat":
        return '"content":' in data and '"delta":{"content"' in data
    if api == "responses":
        return '"type":"response.output_text.delta"' in data
    return '"type":"content_block_delta"' in data


def stream(api, model, counts, i):
    route, body = request(api, model)
    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=600)
    conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, (api, resp.status, resp.read())
    n = 0
    for line in resp:
        line = line.decode()
        if line.startswith("data: ") and delta_event(api, line):
            n += 1
    counts[i] = n


def load(apis):
    counts = [0] * a.streams
    threads = [threading.Thread(target=stream, args=(apis[i % len(apis)], models[i % len(models)], counts, i))
               for i in range(a.streams)]
    t = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(counts) / (time.time() - t), sum(counts)


ratios = []
try:
    load(["chat"])  # warm-up
    for r in range(a.rounds):
        chat, n_chat = load(["chat"])
        mixed, n_mixed = load(["chat", "responses", "messages"])
        ratios.append(mixed / chat)
        print(f"round {r + 1}: chat {chat:.1f} tokens/s ({n_chat} tokens), mixed {mixed:.1f} tokens/s "
              f"({n_mixed} tokens), ratio {mixed / chat:.3f}", flush=True)
    print(f"{a.streams} streams over {len(models)} models: mixed / chat, median of {a.rounds}: "
          f"{statistics.median(ratios):.3f}")
finally:
    server.terminate()
    server.wait()
