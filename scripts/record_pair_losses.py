#!/usr/bin/env python3
"""Records the SFT, reward-model and DPO losses of one batch through the
tiny fixture models, as OpenRLHF 0.11.2 computes them, for
`crates/operators/src/stages/pair_loss_tests.rs`: the file
`crates/operators/tests/data/pair_losses.json`.

The models run in transformers in float64 (SDPA attention, no cache); the
losses are OpenRLHF's own classes (`openrlhf/models/loss.py` of the PyPI
wheel: `GPTLMLoss`, `PairWiseLoss`, `DPOLoss`), loaded from the wheel
without its package `__init__` (which imports the GPU stack). Nothing of
OpenRLHF is kept in this repository.

    python3 -m venv /tmp/fixvenv
    /tmp/fixvenv/bin/pip install torch==2.11.0 transformers==5.24.0 safetensors numpy
    /tmp/fixvenv/bin/python scripts/record_pair_losses.py [WORK_DIR]

Rows are tokenised as weir tokenises them: the prompt through the chat
template with the generation prompt; a response's text, then the
tokenizer's end token.
"""

import importlib.util
import json
import os
import subprocess
import sys
import types
import zipfile

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

OPENRLHF = "0.11.2"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODELS = os.path.join(ROOT, "tests", "fixtures", "models")
OUT = os.path.join(ROOT, "crates", "operators", "tests", "data", "pair_losses.json")
work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/weir-openrlhf"


def openrlhf_losses():
    """`openrlhf.models.loss` from the released wheel."""
    os.makedirs(work, exist_ok=True)
    wheels = [f for f in os.listdir(work) if f.startswith(f"openrlhf-{OPENRLHF}") and f.endswith(".whl")]
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"openrlhf=={OPENRLHF}",
                        "-d", work], check=True)
        wheels = [f for f in os.listdir(work) if f.startswith(f"openrlhf-{OPENRLHF}") and f.endswith(".whl")]
    dest = os.path.join(work, f"openrlhf-{OPENRLHF}")
    zipfile.ZipFile(os.path.join(work, wheels[0])).extractall(dest)
    models = os.path.join(dest, f"openrlhf-{OPENRLHF}.data", "purelib", "openrlhf", "models")
    # The two modules alone: their package's __init__ imports the GPU stack,
    # and utils.py imports deepspeed, which the recorded functions never touch.
    sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
    for name in ("openrlhf", "openrlhf.models"):
        package = types.ModuleType(name)
        package.__path__ = [models] if name.endswith("models") else []
        sys.modules[name] = package
    for name in ("utils", "loss"):
        spec = importlib.util.spec_from_file_location(f"openrlhf.models.{name}", os.path.join(models, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["openrlhf.models.loss"]


def load(cls, name):
    return cls.from_pretrained(os.path.join(MODELS, name), dtype=torch.float64, attn_implementation="sdpa").eval()


def padded(rows, pad=3):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
    return ids, mask


def forward(model, prompts, responses):
    """Logits of prompt + response, right-padded, positions 0.. per row."""
    ids, mask = padded([p + r for p, r in zip(prompts, responses)])
    with torch.no_grad():
        return ids, mask, model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def response_logp_sums(model, prompts, responses):
    """Σ log p(response token | everything before it), per row."""
    ids, _, logits = forward(model, prompts, responses)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    sums = []
    for b, (p, r) in enumerate(zip(prompts, responses)):
        sums.append(logp[b, len(p) - 1:len(p) + len(r) - 1].sum())
    return torch.stack(sums)


def main():
    torch.set_num_threads(1)
    loss = openrlhf_losses()
    tok = AutoTokenizer.from_pretrained(os.path.join(MODELS, "tiny-llama"))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [
        ("Compute: 12+34", "46", "47", 0.0),
        ("Compute: 7+86", "The sum is 93.", "93 or so, maybe 94", 0.5),
        ("Name a colour.", "Blue.", "The sky at night is very dark", 1.0),
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q, _, _, _ in rows]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"] + [eos]
    chosen = [encode(c) for _, c, _, _ in rows]
    rejected = [encode(r) for _, _, r, _ in rows]
    margins = torch.tensor([m for _, _, _, m in rows], dtype=torch.float64)

    # SFT on the chosen responses: token mean over every response token.
    policy = load(AutoModelForCausalLM, "tiny-llama")
    ids, mask, logits = forward(policy, prompt_ids, chosen)
    labels = ids.clone()
    for b, p in enumerate(prompt_ids):
        labels[b, :len(p)] = -100
    labels[mask == 0] = -100
    sft = float(loss.GPTLMLoss()(logits, labels))

    # The reward model: the score at each sequence's last token.
    rm = load(AutoModelForSequenceClassification, "tiny-llama-rm")

    def scores(responses):
        ids, mask = padded([p + r for p, r in zip(prompt_ids, responses)])
        with torch.no_grad():
            return rm(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, 0]

    score_c, score_r = scores(chosen), scores(rejected)
    pairwise = float(loss.PairWiseLoss()(score_c, score_r))
    pairwise_margin = float(loss.PairWiseLoss()(score_c, score_r, margins))

    # DPO: tiny-llama against arith-sft as the frozen reference.
    reference = load(AutoModelForCausalLM, "arith-sft")
    pc, pr = response_logp_sums(policy, prompt_ids, chosen), response_logp_sums(policy, prompt_ids, rejected)
    rc, rr = response_logp_sums(reference, prompt_ids, chosen), response_logp_sums(reference, prompt_ids, rejected)
    beta = 0.1
    dpo = {}
    for name, kw in (("dpo", {}), ("cdpo", dict(label_smoothing=0.1)), ("ipo", dict(ipo=True))):
        value, chosen_rewards, rejected_rewards = loss.DPOLoss(beta, **kw)(pc, pr, rc, rr)
        dpo[name] = dict(loss=float(value), reward_chosen=float(chosen_rewards.mean()),
                         reward_rejected=float(rejected_rewards.mean()), **kw)

    doc = dict(
        generated_by="scripts/record_pair_losses.py",
        versions=dict(openrlhf=OPENRLHF, torch=torch.__version__, transformers=transformers.__version__),
        source=f"openrlhf=={OPENRLHF} openrlhf/models/loss.py (GPTLMLoss, PairWiseLoss, DPOLoss)",
        compute_dtype="float64",
        models=dict(policy="tiny-llama", reward_model="tiny-llama-rm", reference="arith-sft"),
        rows=[dict(prompt=q, chosen=c, rejected=r, margin=m) for q, c, r, m in rows],
        prompt_ids=prompt_ids, chosen_ids=chosen, rejected_ids=rejected,
        sft_loss=sft,
        rm=dict(scores_chosen=score_c.tolist(), scores_rejected=score_r.tolist(), loss=pairwise,
                loss_with_margin=pairwise_margin),
        dpo=dict(beta=beta, policy_chosen=pc.tolist(), policy_rejected=pr.tolist(), reference_chosen=rc.tolist(),
                 reference_rejected=rr.tolist(), **dpo),
    )
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(OUT, json.dumps(dict(sft=sft, rm=pairwise, rm_margin=pairwise_margin, dpo=dpo["dpo"]["loss"])))


if __name__ == "__main__":
    main()
