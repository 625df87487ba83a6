#!/usr/bin/env python3
"""A replica's throughput behind the router against the same replica hit directly, in one run.

    benches/peers/router_overhead.py --multilora target/release/multilora --model MODEL \
        [--router smg|litellm] [--chat-template FILE] [--rounds 6] [--streams 16] \
        [--max-tokens 64] [--json out.json]

One `multilora serve` (MODEL: a checkpoint directory or a GGUF file) and a router in front of
it, one of the two of the replicas tests (docs/DEPLOY.md): the Shepherd Model Gateway (`smg
launch --backend openai`; `pip install smg==1.13.0`; the default) or LiteLLM's proxy (`litellm
--config`, the base model as one deployment; `pip install 'litellm[proxy]==1.100.0'`, its
executable given with `--litellm`). Each round sends 16 concurrent streaming chat requests (`max_tokens` new
tokens each, greedy, EOS ignored) straight to the replica and then through the router, or the
other way round (the order alternates), so that a slow spell of a shared machine falls on both.
Throughput is new tokens over the wall clock of the round, from the first request sent to the
last stream ended; the ratio routed / direct is taken per round and its median reported, with
each side's best round. A warm-up round of each goes first and is not counted.

Only the standard library is used.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

KEY = "bench-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, path, timeout=5):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_until(what, proc, ready, limit=300):
    start = time.time()
    while time.time() - start < limit:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            if ready():
                return
        except Exception:
            pass
        time.sleep(0.2)
    sys.exit(f"{what} was not ready after {limit} s")


def stream(url, model, max_tokens, out, i):
    """One streaming chat request; its new tokens (from the usage chunk) into out[i]."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    out[i] = tokens


def round_trip(url, model, streams, max_tokens):
    """New tokens per second of `streams` concurrent streams through `url`."""
    out = [0] * streams
    threads = [threading.Thread(target=stream, args=(url, model, max_tokens, out, i)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if any(n != max_tokens for n in out):
        sys.exit(f"a stream through {url} ended short: {out}")
    return sum(out) / elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--multilora", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--chat-template")
    ap.add_argument("--router", choices=["smg", "litellm"], default="smg")
    ap.add_argument("--smg", default="smg")
    ap.add_argument("--litellm", default="litellm")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()

    port, router_port, metrics_port = free_port(), free_port(), free_port()
    serve = [a.multilora, "serve", "--model", a.model, "--served-model-name", "base", "--port", str(port),
             "--api-key", KEY, "--max-num-seqs", str(a.streams)]
    if a.chat_template:
        serve += ["--chat-template", a.chat_template]
    env = dict(os.environ, RUST_LOG="warn")
    replica = subprocess.Popen(serve, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router = config_file = None
    try:
        direct = f"http://127.0.0.1:{port}"
        wait_until("multilora serve", replica, lambda: get(direct, "/health")[0] == 200)
        routed = f"http://127.0.0.1:{router_port}"
        if a.router == "smg":
            router = subprocess.Popen(
                [a.smg, "launch", "--backend", "openai", "--host", "127.0.0.1", "--port", str(router_port),
                 "--worker-urls", direct, "--api-key", KEY, "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(metrics_port), "--log-level", "warn"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until("smg", router, lambda: '"healthy_workers":1' in get(routed, "/readiness")[1])
        else:
            # The test's routing settings (crates/multilora-cli/tests/replicas.rs), with message logging
            # and spend logs off: they cost the proxy CPU on the replica's cores. JSON is YAML.
            config = {"model_list": [{"model_name": "base", "litellm_params": {
                "model": "openai/base", "api_base": direct + "/v1", "api_key": KEY, "max_retries": 0}}],
                "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 1},
                "litellm_settings": {"turn_off_message_logging": True, "drop_params": True, "disable_token_counter": True},
                "general_settings": {"disable_spend_logs": True, "disable_error_logs": True}}
            config_file = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
            with config_file:
                json.dump(config, config_file)
            router = subprocess.Popen(
                [a.litellm, "--config", config_file.name, "--host", "127.0.0.1", "--port", str(router_port),
                 "--num_workers", "1"],
                env=dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR"),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until("litellm", router, lambda: get(routed, "/health/liveliness")[0] == 200)
        for url in (direct, routed):
            round_trip(url, "base", a.streams, a.max_tokens)  # warm-up
        rows = []
        for r in range(a.rounds):
            order = [("direct", direct), ("routed", routed)]
            if r % 2:
                order.reverse()
            got = {name: round_trip(url, "base", a.streams, a.max_tokens) for name, url in order}
            got["ratio"] = got["routed"] / got["direct"]
            rows.append(got)
            print(f"round {r + 1}: direct {got['direct']:.1f} tok/s, routed {got['routed']:.1f} tok/s, "
                  f"routed/direct {got['ratio']:.3f}", flush=True)
        summary = {
            "model": a.model, "router": a.router, "streams": a.streams, "max_tokens": a.max_tokens, "rounds": rows,
            "best_direct": max(r["direct"] for r in rows), "best_routed": max(r["routed"] for r in rows),
            "median_ratio": statistics.median(r["ratio"] for r in rows),
        }
        print(f"best direct {summary['best_direct']:.1f} tok/s, best routed {summary['best_routed']:.1f} tok/s, "
              f"median routed/direct {summary['median_ratio']:.3f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f, indent=1)
    finally:
        for p in (router, replica):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        if config_file is not None:
            os.unlink(config_file.name)


if __name__ == "__main__":
    main()
