#!/usr/bin/env python3
"""transformers' side of `cargo bench --bench generation`: the same checkpoint,
prompts and settings as weir's run, timed the same way. Prints one JSON line.

usage: hf_generate.py MODEL_DIR PROMPTS_JSON N_SAMPLES NEW_TOKENS THREADS
"""
import json, os, sys, time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForCausalLM

model_dir, prompts_path, n, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
torch.manual_seed(0)
prompts = json.load(open(prompts_path))
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
eos = model.generation_config.eos_token_id
eos = eos if isinstance(eos, list) else [eos]
width = max(len(p) for p in prompts)
pad = 3
ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])


def run():
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             num_return_sequences=n, max_new_tokens=new, min_new_tokens=new, suppress_tokens=eos,
                             pad_token_id=pad)
    return out.shape[0] * (out.shape[1] - width)


run()  # warm-up
times = []
for _ in range(3):
    t = time.perf_counter()
    tokens = run()
    times.append(time.perf_counter() - t)
times.sort()
print(json.dumps({"tokens": tokens, "seconds": times[1], "tokens_per_s": tokens / times[1]}))
