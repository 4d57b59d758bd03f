#!/usr/bin/env python3
"""Records what `peft` computes with an adapter folder weir wrote.

    WEIR_WRITE_PEFT_CASE=/tmp/peft-case cargo test -p weir-gpu --test reference peft_loads
    python scripts/record_peft_lora.py /tmp/peft-case

loads tests/fixtures/models/tiny-llama in float64 with transformers,
puts the adapter folder on it with peft (PeftModel.from_pretrained), and
writes crates/gpu/tests/data/peft_lora_logits.json: the logits of two
sequences, the keys peft found missing or unexpected when loading, and how
far the adapted logits are from the base model's (so the adapters act).
"""

import json
import pathlib
import sys

import peft
import torch
import transformers
from peft.utils import load_peft_weights, set_peft_model_state_dict

root = pathlib.Path(__file__).resolve().parent.parent
adapter = pathlib.Path(sys.argv[1])
base_dir = root / "tests/fixtures/models/tiny-llama"
out = root / "crates/gpu/tests/data/peft_lora_logits.json"

torch.set_grad_enabled(False)
ids = torch.tensor([[1, 5, 9, 2], [7, 3, 11, 4]])
base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
base_logits = base(ids).logits.clone()
model = peft.PeftModel.from_pretrained(base, adapter)
model = model.double()
# Loading again reports what the folder lacks or has beyond PEFT's names.
result = set_peft_model_state_dict(model, load_peft_weights(str(adapter)))
missing = sorted(k for k in result.missing_keys if "lora_" in k)
logits = model(ids).logits
json.dump(
    {
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "input_ids": ids.tolist(),
        "logits": logits.tolist(),
        "missing_keys": missing,
        "unexpected_keys": sorted(result.unexpected_keys),
        "base_differs_by": (logits - base_logits).abs().max().item(),
    },
    out.open("w"),
)
print(f"wrote {out}: adapted logits differ from the base by {(logits - base_logits).abs().max().item():.3e}")
