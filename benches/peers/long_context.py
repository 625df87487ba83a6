#!/usr/bin/env python3
"""Long prompts, multilora against llama.cpp: one stream, each engine alone on the machine.

For each prompt size (in tokens; random token ids, a new prompt each time, so nothing is cached):
- the cold prompt with `max_tokens` 1: prompt tokens/s (time to first token);
- the same prompt again, streamed, `--decode` new tokens: decode tokens/s at that depth (first
  token to last, so the cached or recomputed prompt does not count);
- the server's peak resident memory so far (`VmHWM`).

Then `--resend`: `--resend-count` prompts of the largest size one after the other, and the first
of them again: the resent prompt's time to first token. And `--gaps S:N` (multilora only:
llama-server would need `S + 1` slots, each with the whole context): `S` streams decoding while an `N`-token prompt arrives, each stream's largest gap between
two tokens while the prompt is served, and whether every stream and the prompt finished (`S` 16
and `N` the context length is the soak: the longest legal prompt among 16 streams).

    benches/peers/long_context.py --llamacpp DIR --multilora target/release/multilora \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --sizes 420,1600,4640,6950 --ctx 8192

llama-server gets `--parallel 1 -c CTX`, flash attention on its default, 2 threads; multilora
`--max-model-len CTX`. Both run on `--threads` threads.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import Engine, wait_ready  # noqa: E402  (the peers' shared clients)


def peak_rss_gib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 2**20
    return float("nan")


class Server:
    def __init__(self, kind, a, port, log):
        self.kind, self.port = kind, port
        env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads), RUST_LOG="warn")
        if kind == "llama.cpp":
            cmd = [os.path.join(a.llamacpp, "llama-server"), "-m", a.gguf, "-t", str(a.threads), "-tb",
                   str(a.threads), "--parallel", "1", "-c", str(a.ctx), "--host", "127.0.0.1", "--port", str(port),
                   "--no-webui"] + (["--no-repack"] if a.no_repack else [])
        else:
            cmd = [a.multilora, "serve", "--model", a.gguf, "--served-model-name", "base", "--port", str(port),
                   "--max-model-len", str(a.ctx)] + a.multilora_arg
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        wait_ready(port, self.proc, kind)

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def engine(self):
        """A client of this server (one per thread: it keeps its last stream's finish reason)."""
        return Engine("multilora" if self.kind == "multilora" else "llamacpp", self.port, [], cache_prompt=True)

    def first_token(self, prompt):
        """Seconds to the answer of a one-token request."""
        return self.engine().run(prompt, 1, None)[1]

    def token_times(self, prompt, n):
        """The arrival time of every streamed event that carries text."""
        return self.engine().stream_times(prompt, n, None)


def gaps(server, prompt, streams, n):
    """`streams` streams of 512 tokens; once each has its first token, an `n`-token prompt; each
    stream's largest gap while the prompt is served."""
    times = [None] * streams
    ok = [False] * streams

    def stream(i):
        client = server.engine()
        times[i] = client.stream_times(prompt(16), 512, None)
        ok[i] = client.finish == "length"

    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    start = time.perf_counter() - t0
    dt = server.first_token(prompt(n))
    end = start + dt
    for t in threads:
        t.join()
    worst = []
    for i, ts in enumerate(times):
        # A stream's arrival times, from its own start: shifted to the common clock by its start,
        # which is within a few ms of t0 for all (their threads start together).
        inside = [b - a for a, b in zip(ts, ts[1:]) if start <= b <= end + 0.5]
        worst.append(max(inside) if inside else float("nan"))
    row = {"gaps_streams": streams, "prompt_tokens": n, "prompt_s": dt, "largest_gap_s": max(worst),
           "median_largest_gap_s": sorted(worst)[len(worst) // 2], "all_finished": all(ok)}
    print(f"{server.kind:9} {streams} streams while a {n}-token prompt arrives ({dt:.1f} s): largest gap "
          f"{max(worst) * 1000:.0f} ms (median of streams {row['median_largest_gap_s'] * 1000:.0f} ms), "
          f"every stream finished: {all(ok)}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llamacpp", help="folder with llama-server (leave out to run multilora alone)")
    ap.add_argument("--multilora", required=True)
    ap.add_argument("--multilora-arg", action="append", default=[], help="one more argument to multilora serve")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--sizes", default="420,1600,4640,6950")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=129)
    ap.add_argument("--resend", action="store_true")
    ap.add_argument("--resend-count", type=int, default=3)
    ap.add_argument("--gaps", action="append", default=[],
                    help="S:N — S streams decoding while an N-token prompt arrives (may repeat)")
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn from 100..vocab-100")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "multilora-long-context.log"))
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    rng = random.Random(1)

    def prompt(n):
        return [rng.randrange(100, a.vocab - 100) for _ in range(n)]

    log = open(a.log, "w")
    print(f"servers' output: {a.log}", file=sys.stderr)
    kinds = (["llama.cpp"] if a.llamacpp else []) + ["multilora"]
    results = {}
    for kind in kinds:
        server = Server(kind, a, 18700, log)
        rows = []
        try:
            server.first_token(prompt(16))
            for n in sizes:
                p = prompt(n)
                dt = server.first_token(p)
                times = server.token_times(p, a.decode)
                decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
                row = {"tokens": n, "ttft_s": dt, "prompt_tps": n / dt, "decode_tps": decode,
                       "peak_rss_gib": peak_rss_gib(server.proc.pid)}
                rows.append(row)
                print(f"{kind:9} {n:6} tokens: first token {dt:7.2f} s, {n / dt:7.1f} prompt tok/s, decode at depth "
                      f"{decode:6.1f} tok/s, peak RSS {row['peak_rss_gib']:.2f} GiB", flush=True)
            if a.resend:
                ps = [prompt(max(sizes)) for _ in range(a.resend_count)]
                for p in ps:
                    server.first_token(p)
                dt = server.first_token(ps[0])
                rows.append({"resent_tokens": max(sizes), "after": a.resend_count - 1, "ttft_s": dt})
                print(f"{kind:9} a {max(sizes)}-token prompt resent after {a.resend_count - 1} others: "
                      f"first token {dt:.2f} s", flush=True)
            for g in a.gaps if kind == "multilora" else []:
                rows.append(gaps(server, prompt, *map(int, g.split(":"))))
        finally:
            server.stop()
        results[kind] = rows
    if a.llamacpp:
        for ours, theirs in zip(results["multilora"], results["llama.cpp"]):
            if "tokens" in ours:
                print(f"{ours['tokens']:6} tokens: prompt {ours['prompt_tps'] / theirs['prompt_tps']:.2f}x, "
                      f"decode at depth {ours['decode_tps'] / theirs['decode_tps']:.2f}x llama.cpp")
    if a.json:
        json.dump(results, open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
