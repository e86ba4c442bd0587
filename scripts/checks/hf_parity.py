"""Checks that model directories written by `trainer init-model` load unchanged in transformers'
AutoModelForCausalLM and that its logits match xdistill's decoder (outside CI: needs torch and
transformers in a venv).

    python scripts/checks/hf_parity.py MODEL_DIR LOGITS.json

LOGITS.json is written by `cargo run -p xdistill-trainer --example dump_logits -- MODEL_DIR IDS...`:
{"ids": [...], "logits": [[...], ...]} for one sequence.
"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

model_dir, dump = sys.argv[1], sys.argv[2]
ref = json.load(open(dump))
model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
model.eval()
missing = [n for n, p in model.named_parameters() if p.abs().sum() == 0 and n.endswith("weight")]
with torch.no_grad():
    out = model(torch.tensor([ref["ids"]])).logits[0]
ours = torch.tensor(ref["logits"])
diff = (out - ours).abs().max().item()
print(f"{model_dir}: {type(model).__name__}, logits {tuple(out.shape)}, max |hf - xdistill| = {diff:.3e}")
assert out.shape == ours.shape, (out.shape, ours.shape)
assert diff < 1e-4, diff
