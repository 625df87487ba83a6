#!/usr/bin/env python3
"""multilora against llama.cpp on the same GGUF file, the same adapters and the same requests, one
engine after the other in one run, so that every ratio is taken from figures measured together.

    benches/peers/compare.py --llamacpp DIR/lcpp-build/bin --multilora target/release/multilora \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --adapters ADAPTER_DIR [--threads 2] [--json out.json]

ADAPTER_DIR holds llama.cpp LoRA files (eight for SmolLM2: `cargo run --release -p multilora-adapter
--example peer_adapters -- ADAPTER_DIR`; Gemma 3's three: `tests/fixtures/gemma3/gguf-lora` with
`--reference tests/fixtures/gemma3/expected/transformers.json`); both engines serve the same files.
Workloads (prompts: the reference's prompts, by default the chat-templated questions of
tests/fixtures/smollm2/expected/transformers.json, sent as token ids; greedy; EOS ignored):

Both servers run at once, idle while the other works; each round runs llama-bench, then the four
workloads on one engine and on the other (the order alternating), so that a slow spell of a shared
machine falls on both. Reported: each figure's best round, and each ratio's median over the rounds
(paired: both sides of a ratio from the same round).

- llama-bench pp512 / tg128 (its own prompt and generation, 2 threads, one repetition a round);
- one stream, 128 new tokens: decode tokens/s from the stream's own clock (after its first token),
  against llama-bench's tg128;
- prompt processing, a 512-token prompt (another one each round; no prefix cache on either side)
  and 1 new token: prompt tokens/s, against pp512;
- 16 concurrent streams of 64 new tokens on the base model, and over the adapters (in turn): new tokens/s over the wall clock, llama-server with 16 parallel slots (it runs requests
  whose adapters differ in separate batches);
- 16 concurrent streams on the base model, sampled as chat clients ask (temperature 0.8, top-p 0.95,
  top-k 40; llama.cpp's chain set to those three alone: min-p, typical-p, XTC and DRY off).

`--workloads decode,prompt` runs only those (an 8B-shaped file on 2 cores: the streams take long).
Every round cross-checks llama-server's one stream and 512-token prompt against llama-bench's tg128
and pp512: a round where they differ by more than 2x is a harness fault, reported (exit status 3),
and the ratios are then no result.

`--sampling-table` measures multilora alone instead: 16 and 64 concurrent completions of 32 new
tokens on the base model under each sampling setting of the sampling issue's table (greedy, no
sampling fields at all — OpenAI's default temperature 1 —, temperature 0.8, top-p, top-k, all
filters, greedy with 5 logprobs), the settings in a new order each round; each figure against the
greedy one of the same round and concurrency.

Only the standard library is used.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE = os.path.join(ROOT, "tests/fixtures/smollm2/expected/transformers.json")


def post(port, path, body, timeout=900):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def wait_ready(port, proc, what):
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    sys.exit(f"{what} did not become ready")


class Engine:
    """One server: how to address a request to `adapter` (None = base) and read its tokens."""

    def __init__(self, kind, port, adapters, cache_prompt=False):
        """`cache_prompt`: llama-server may reuse a prompt's KV (as multilora's prefix cache does
        unless it is started without it)."""
        self.kind, self.port, self.adapters, self.cache_prompt = kind, port, adapters, cache_prompt
        # The finish reason of the last streamed request (multilora).
        self.finish = None

    def body(self, prompt, n, adapter, stream, sampling=None):
        """`sampling`: the OpenAI fields of the request (None: greedy); llama-server gets the same
        settings in its own names, its sampler chain cut to top-k, top-p and temperature."""
        if self.kind == "multilora":
            fields = {"temperature": 0} if sampling is None else sampling
            return "/v1/completions", {"model": adapter or "base", "prompt": prompt, "max_tokens": n,
                                       "ignore_eos": True, "stream": stream, **fields}
        lora = [{"id": i, "scale": 1.0 if a == adapter else 0.0} for i, a in enumerate(self.adapters)]
        if sampling is None:
            fields = {"temperature": 0, "top_k": 1}
        else:
            fields = {"temperature": sampling.get("temperature", 1.0), "top_k": sampling.get("top_k", 0),
                      "top_p": sampling.get("top_p", 1.0), "min_p": 0.0, "typical_p": 1.0,
                      "samplers": ["top_k", "top_p", "temperature"]}
        return "/completion", {"prompt": prompt, "n_predict": n, "ignore_eos": True, "cache_prompt": self.cache_prompt,
                               "lora": lora, "stream": stream, **fields}

    def run(self, prompt, n, adapter, sampling=None):
        """Returns (tokens, seconds from sending to the last token)."""
        path, body = self.body(prompt, n, adapter, False, sampling)
        t0 = time.perf_counter()
        with post(self.port, path, body) as r:
            out = json.load(r)
        tokens = out["usage"]["completion_tokens"] if self.kind == "multilora" else out["tokens_predicted"]
        return tokens, time.perf_counter() - t0

    def stream_times(self, prompt, n, adapter):
        """The arrival time of every streamed event that carries a token; the finish reason in
        `self.finish`."""
        path, body = self.body(prompt, n, adapter, True)
        times, self.finish = [], None
        t0 = time.perf_counter()
        with post(self.port, path, body) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                # One event per token: a choice's chunk (multilora; the usage chunk has none), a
                # not-yet-stopped chunk (llama-server).
                token = bool(ev.get("choices")) if self.kind == "multilora" else not ev.get("stop", False)
                if token:
                    times.append(time.perf_counter() - t0)
                for choice in ev.get("choices") or []:
                    self.finish = choice.get("finish_reason") or self.finish
        return times


def concurrent(engine, prompts, n, adapters_of, sampling=None):
    out = [None] * len(prompts)

    def one(i):
        out[i] = engine.run(prompts[i], n, adapters_of(i), sampling)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(o[0] for o in out)
    assert tokens == n * len(prompts), out
    return tokens / wall


def warm_up(engine):
    """Every adapter once."""
    concurrent(engine, [[1, 2, 3]] * len(engine.adapters), 4, lambda i: engine.adapters[i])


# The workloads `--workloads` picks from, in the order they run.
WORKLOADS = ("decode", "prompt", "streams", "adapters", "sampled")


def workloads(engine, prompts, long_prompt, only=WORKLOADS):
    """One round of the workloads in `only`; `long_prompt` differs from round to round, so that no
    cache of either engine can serve it."""
    adapters = engine.adapters
    res = {}
    p16 = [prompts[i % len(prompts)] for i in range(16)]
    if "decode" in only:
        t = engine.stream_times(prompts[0], 128, None)
        res["1 stream decode"] = (len(t) - 1) / (t[-1] - t[0])
    if "prompt" in only:
        tokens, secs = engine.run(long_prompt, 1, None)
        res["prompt 512"] = len(long_prompt) / secs
    if "streams" in only:
        res["16 streams base"] = concurrent(engine, p16, 64, lambda i: None)
    if "adapters" in only:
        res[f"16 streams {len(adapters)} adapters"] = concurrent(engine, p16, 64,
                                                                 lambda i: adapters[i % len(adapters)])
    if "sampled" in only:
        res["16 streams sampled"] = concurrent(engine, p16, 64, lambda i: None, SAMPLED)
    return res


# llama-server's own figures against llama-bench's on the same file and threads: further apart
# than this, the harness (not either engine) is at fault, and the round's ratios are no result.
CROSS_CHECK = {"1 stream decode": "llama-bench tg128", "prompt 512": "llama-bench pp512"}
CROSS_LIMIT = 2.0


def cross_check(figures):
    """`(what, ratio)` for each of llama-server's figures that llama-bench measured too."""
    out = []
    for w, bench in CROSS_CHECK.items():
        if f"llama.cpp {w}" in figures and bench in figures:
            out.append((f"llama-server {w} / {bench}", figures[f"llama.cpp {w}"] / figures[bench]))
    return out


# What chat clients commonly send (and llama.cpp's own defaults for these three).
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 40}

# The sampling issue's table: each setting's request fields (None: greedy, temperature 0).
TABLE = [
    ("temperature 0", None),
    ("no sampling fields", {}),
    ("temperature 0.8", {"temperature": 0.8}),
    ("temperature 0.7, top_p 0.9", {"temperature": 0.7, "top_p": 0.9}),
    ("temperature 0.8, top_k 40", {"temperature": 0.8, "top_k": 40}),
    ("temperature 0.8, top_k 40, top_p 0.95, min_p 0.05",
     {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}),
    ("temperature 0, logprobs 5", {"temperature": 0, "logprobs": 5}),
]


def sampling_table(a, prompts, engine):
    """The table's settings at 16 and 64 streams, `a.rounds` rounds in rotated orders; per setting
    the best figure and the median of its ratios to the same round's greedy figure."""
    rounds = []
    for r in range(a.rounds):
        figures = {}
        order = TABLE[r % len(TABLE):] + TABLE[:r % len(TABLE)]
        for streams in (16, 64):
            batch = [prompts[i % len(prompts)] for i in range(streams)]
            for name, fields in order:
                figures[f"{streams} streams, {name}"] = concurrent(engine, batch, 32, lambda i: None, fields)
        rounds.append(figures)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    out = {}
    for streams in (16, 64):
        for name, _ in TABLE:
            key = f"{streams} streams, {name}"
            greedy = f"{streams} streams, temperature 0"
            out[key] = {"best": max(r[key] for r in rounds), "vs greedy": median([r[key] / r[greedy] for r in rounds])}
            print(f"{key:70s} {out[key]['best']:8.1f} tokens/s  {out[key]['vs greedy']:5.2f}x greedy")
    return {"rounds": rounds, "table": out}


def llama_bench(a):
    out = subprocess.run([os.path.join(a.llamacpp, "llama-bench"), "-m", a.gguf, "-t", str(a.threads), "-p", "512",
                          "-n", "128", "-r", "1", "-o", "json"] + (["--repack", "0"] if a.no_repack else []),
                         capture_output=True, text=True, check=True)
    return {f"llama-bench {'pp512' if row['n_prompt'] else 'tg128'}": row["avg_ts"] for row in json.loads(out.stdout)}


def multilora_cmd(a, names, files, port):
    # As llama-server's `cache_prompt: false` and `--cache-ram 0`: every prompt computed in full.
    cmd = [a.multilora, "serve", "--model", a.gguf, "--served-model-name", "base", "--port", str(port),
           "--max-loras", str(len(files)), "--max-lora-rank", "32", "--no-enable-prefix-caching"]
    for n, f in zip(names, files):
        cmd += ["--lora-modules", f"{n}={os.path.join(a.adapters, f)}"]
    return cmd


def start(cmd, port, what, log, env=None):
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    wait_ready(port, proc, what)
    return proc


def stop(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llamacpp", required=True, help="folder with llama-server and llama-bench")
    ap.add_argument("--multilora", required=True, help="the multilora binary (release build)")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--adapters", required=True, help="folder of llama.cpp LoRA files (eight for SmolLM2)")
    ap.add_argument("--reference", default=REFERENCE,
                    help="the transformers.json whose prompts are sent (default: SmolLM2's fixture)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-repack", action="store_true",
                    help="llama.cpp without weight repacking: where its AMX path crashes (a VM that reports AMX "
                         "but does not enable it), it then runs the AVX-512 VNNI / AVX2 code of any other CPU")
    ap.add_argument("--sampling-table", action="store_true",
                    help="multilora alone: the sampling settings' table at 16 and 64 streams against greedy")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="which workloads to run, comma-separated from " + ", ".join(WORKLOADS)
                         + " (default all; an 8B-shaped file: decode,prompt)")
    ap.add_argument("--json")
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "multilora-compare.log"),
                    help="where both servers' output goes (default: the system's temporary folder, never the "
                         "checkout)")
    a = ap.parse_args()
    only = tuple(w.strip() for w in a.workloads.split(",") if w.strip())
    unknown = [w for w in only if w not in WORKLOADS]
    assert not unknown, f"unknown workloads {unknown}: pick from {WORKLOADS}"
    cases = json.load(open(a.reference))["cases"]
    prompts = [c["prompt_ids"] for c in cases if c["adapter"] == "base"]
    # A 512-token prompt: the reference prompts and answers, one after the other.
    long_prompt_base = [t for c in cases for t in c["prompt_ids"] + c["output_ids"]]
    files = sorted(f for f in os.listdir(a.adapters) if f.endswith(".gguf"))
    names = [f[:-5] for f in files]
    assert files, f"no .gguf LoRA files in {a.adapters}"
    log = open(a.log, "w")
    print(f"servers' output: {a.log}", file=sys.stderr)

    port_l, port_m = 18600, 18500
    lora = ",".join(os.path.join(a.adapters, f) for f in files)
    if a.sampling_table:
        ours = start(multilora_cmd(a, names, files, port_m), port_m, "multilora serve", log,
                     dict(os.environ, RAYON_NUM_THREADS=str(a.threads), RUST_LOG="warn"))
        try:
            engine = Engine("multilora", port_m, names)
            warm_up(engine)
            result = sampling_table(a, prompts, engine)
        finally:
            stop(ours)
        if a.json:
            json.dump(result, open(a.json, "w"), indent=2)
        return
    llama = start([os.path.join(a.llamacpp, "llama-server"), "-m", a.gguf, "--lora", lora, "--lora-init-without-apply",
                   "-t", str(a.threads), "-tb", str(a.threads), "--parallel", "16", "-cb", "-c", "16384",
                   "--cache-ram", "0", "--host", "127.0.0.1", "--port", str(port_l), "--no-webui"]
                  + (["--no-repack"] if a.no_repack else []),
                  port_l, "llama-server", log)
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads), RUST_LOG="warn")
    ours = subprocess.Popen(multilora_cmd(a, names, files, port_m), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    rounds = []
    try:
        wait_ready(port_m, ours, "multilora serve")
        engines = [("llama.cpp", Engine("llamacpp", port_l, names)), ("multilora", Engine("multilora", port_m, names))]
        for _, e in engines:
            warm_up(e)
        # The engines take turns within each round (both idle while the other runs), so that a slow
        # spell of a shared machine falls on both; each round has its own 512-token prompt.
        for r in range(a.rounds):
            shift = 37 * (r + 1)
            long_prompt = (long_prompt_base[shift:] + long_prompt_base[:shift])[:512]
            figures = llama_bench(a)
            for name, e in engines if r % 2 == 0 else engines[::-1]:
                for k, v in workloads(e, prompts, long_prompt, only).items():
                    figures[f"{name} {k}"] = v
            rounds.append(figures)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    finally:
        stop(llama)
        stop(ours)

    pairs = {
        "1 stream decode / tg128": ("multilora 1 stream decode", "llama-bench tg128"),
        "prompt 512 / pp512": ("multilora prompt 512", "llama-bench pp512"),
        "16 streams base / llama-server": ("multilora 16 streams base", "llama.cpp 16 streams base"),
        f"16 streams {len(names)} adapters / llama-server": (f"multilora 16 streams {len(names)} adapters",
                                                              f"llama.cpp 16 streams {len(names)} adapters"),
        "16 streams sampled / llama-server": ("multilora 16 streams sampled", "llama.cpp 16 streams sampled"),
    }
    report = {k: max(r[k] for r in rounds) for k in rounds[0]}
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    pairs = {k: (n, d) for k, (n, d) in pairs.items() if n in rounds[0] and d in rounds[0]}
    ratios = {k: median([r[n] / r[d] for r in rounds]) for k, (n, d) in pairs.items()}
    checks = {w: [c for r in rounds for (x, c) in cross_check(r) if x == w] for w, _ in cross_check(rounds[0])}
    faults = {w: v for w, v in checks.items() if any(not 1 / CROSS_LIMIT <= c <= CROSS_LIMIT for c in v)}
    for k, v in report.items():
        print(f"{k:40s} {v:10.1f} tokens/s (best of {a.rounds} rounds)")
    for w, v in checks.items():
        print(f"{w:40s} {median(v):10.2f}x (cross-check, rounds {', '.join(f'{c:.2f}' for c in v)})")
    if faults:
        for w, v in faults.items():
            print(f"HARNESS FAULT: {w} outside {1 / CROSS_LIMIT:.1f}-{CROSS_LIMIT:.1f}x in a round "
                  f"({', '.join(f'{c:.2f}' for c in v)}): the ratios below are no result", file=sys.stderr)
    for k, v in ratios.items():
        print(f"{k:40s} {v:10.2f}x (median of the rounds' ratios)")
    if a.json:
        json.dump({"rounds": rounds, "best": report, "ratios": ratios, "cross_check": checks,
                   "harness_faults": sorted(faults)}, open(a.json, "w"), indent=2)
    if faults:
        sys.exit(3)


if __name__ == "__main__":
    main()
