#!/usr/bin/env python3
"""transformers + PEFT on a GPU, on exactly the workload of the device check's engine figures.

The CPU peer bench's workload (../shared/peers/bench_peft.py), on `device="cuda"`: a random Llama
(vocab 32000, hidden 1024, intermediate 2816, 8 layers, 16 heads, 8 KV heads), 8 LoRA adapters of
rank 16 (alpha 32) on the seven projections with random A and B; 16 requests x 64 random prompt
ids (numpy default_rng(0)), 32 greedy new tokens, EOS ignored. Scenarios: `base` (plain
LlamaForCausalLM) and `mixed_8` (PeftModel with the 8 adapters, 2 rows per adapter through
`adapter_names=`). Each: one warm-up, then --runs timed generate(32) and generate(1) (~prefill),
medians; the GPU is synchronized before every clock read. TF32 is off.

The weights go to --workdir (base/, a0/ .. a7/, ordinary Hugging Face and PEFT directories) once;
the device check then serves the same directories with multilora and reads this script's JSON
(figures, and the prompt ids, so both run the same prompts).

Usage: python3 bench_peft_cuda.py --workdir DIR [--dtype f32|bf16 ...] [--runs 3] [--json out.json]
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

import peft
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

CFG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MODS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_AD, BATCH, PROMPT, NEW = 8, 16, 64, 32
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def prepare(workdir):
    """The base and the 8 adapters, written once (f32 on disk, like the CPU peer bench)."""
    base_dir = os.path.join(workdir, "base")
    if not os.path.exists(os.path.join(base_dir, "model.safetensors")):
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(**CFG))
        m.save_pretrained(base_dir)
        for i in range(N_AD):
            pm = get_peft_model(
                LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                LoraConfig(r=16, lora_alpha=32, target_modules=MODS, task_type="CAUSAL_LM"),
            )
            g = torch.Generator().manual_seed(1000 + i)
            with torch.no_grad():
                for n, p in pm.named_parameters():
                    if "lora_A" in n or "lora_B" in n:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            pm.save_pretrained(os.path.join(workdir, f"a{i}"))
            del pm
    return base_dir


def timed(fn, runs):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--dtype", nargs="+", default=["f32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    assert torch.cuda.is_available(), "no CUDA device for torch"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(a.workdir, exist_ok=True)
    t0 = time.perf_counter()
    base_dir = prepare(a.workdir)
    prep_s = time.perf_counter() - t0

    rng = np.random.default_rng(0)
    ids_np = rng.integers(3, CFG["vocab_size"], size=(BATCH, PROMPT))
    ids = torch.tensor(ids_np, device="cuda")
    mask = torch.ones_like(ids)
    names = [f"a{i // 2}" for i in range(BATCH)]

    def gen(model, n, **kw):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, **kw)
        assert out.shape == (BATCH, PROMPT + n), out.shape
        return out[:, PROMPT:]

    results = {}
    for dname in a.dtype:
        dtype = DTYPES[dname]
        res = {}

        def run(name, model, **kw):
            t_full = timed(lambda: gen(model, NEW, **kw), a.runs)
            t_pre = timed(lambda: gen(model, 1, **kw), a.runs)
            full, pre = statistics.median(t_full), statistics.median(t_pre)
            res[name] = dict(
                gen32_s_runs=[round(t, 4) for t in t_full],
                gen32_s_median=round(full, 4),
                prefill_s_median=round(pre, 4),
                new_tokens_per_s=round(BATCH * NEW / full, 1),
                prefill_tokens_per_s=round(BATCH * PROMPT / pre, 1),
            )
            print(dname, name, json.dumps(res[name]), flush=True)

        base = LlamaForCausalLM.from_pretrained(base_dir, dtype=dtype).to("cuda").eval()
        run("base", base)
        del base
        pm = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(base_dir, dtype=dtype), os.path.join(a.workdir, "a0"),
            adapter_name="a0", autocast_adapter_dtype=False,
        )
        for i in range(1, N_AD):
            pm.load_adapter(os.path.join(a.workdir, f"a{i}"), adapter_name=f"a{i}", autocast_adapter_dtype=False)
        pm = pm.to("cuda").eval()
        run("mixed_8", pm, adapter_names=names)
        del pm
        torch.cuda.empty_cache()
        results[dname] = res

    report = dict(
        info=dict(
            torch=torch.__version__,
            cuda=torch.version.cuda,
            transformers=transformers.__version__,
            peft=peft.__version__,
            gpu=torch.cuda.get_device_name(0),
            workload=dict(batch=BATCH, prompt=PROMPT, new_tokens=NEW, adapters=N_AD, rank=16, modules=MODS),
            prepare_s=round(prep_s, 1),
        ),
        prompt_ids=ids_np.tolist(),
        adapter_names=names,
        results=results,
    )
    print(json.dumps(report["results"], indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
