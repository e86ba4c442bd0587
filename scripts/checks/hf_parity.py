"""Parity with transformers on every architecture and RoPE scaling kind (outside CI: needs torch
and transformers in a venv). For each case of `trainer/tests/fixtures/hf/make_fixtures.py`
(the same init-model arguments, init std 0.1) it makes the model with a longer context, scores
one sequence much longer than the sliding windows and original context lengths with
transformers (eager attention, f32) and with xdistill's decoder (`dump_logits`), and reports
max |Δ| of the log-probs. Exits non-zero above 1e-4.

    cargo build -p xdistill-trainer-cli --bin trainer -p xdistill-trainer --example dump_logits
    python scripts/checks/hf_parity.py target/debug/trainer target/debug/examples/dump_logits \
        "$(scripts/get-tokenizers.sh)" [SEQ_LEN]
"""
import importlib.util, json, os, subprocess, sys, tempfile

import torch
from transformers import AutoModelForCausalLM

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "fixtures", os.path.join(here, "..", "..", "trainer", "tests", "fixtures", "hf", "make_fixtures.py"))
fixtures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fixtures)

GOAL = 1e-4


def with_context(args, n):
    """The fixture arguments with `--max-position-embeddings n`."""
    out = list(args)
    i = out.index("--max-position-embeddings")
    out[i + 1] = str(n)
    return out


def main():
    trainer, dump, tokenizers = sys.argv[1:4]
    seq_len = int(sys.argv[4]) if len(sys.argv) > 4 else 200
    worst_all = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name, (tok, args) in fixtures.CASES.items():
            d = os.path.join(tmp, name)
            common = with_context(fixtures.COMMON, max(2 * seq_len, 64))
            subprocess.run([trainer, "init-model", *common, *args, "--tokenizer",
                            os.path.join(tokenizers, tok, "tokenizer.json"), "--out", d],
                           check=True, stderr=subprocess.DEVNULL)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
            model.eval()
            vocab = model.config.get_text_config().vocab_size
            g = torch.Generator().manual_seed(seq_len)
            ids = torch.randint(0, vocab, (seq_len,), generator=g).tolist()
            with torch.no_grad():
                hf = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            out = os.path.join(tmp, name + ".json")
            subprocess.run([dump, d, out, *map(str, ids)], check=True)
            ours = torch.log_softmax(torch.tensor(json.load(open(out))["logits"], dtype=torch.float64), dim=-1)
            assert ours.shape == hf.shape, (ours.shape, hf.shape)
            diff = (ours - hf).abs().max().item()
            worst_all = max(worst_all, diff)
            print(f"{name:28s} {type(model).__name__:22s} {seq_len} tokens  max |Δ log-prob| = {diff:.2e}")
    print(f"worst: {worst_all:.2e} (goal ≤ {GOAL:.0e})")
    sys.exit(0 if worst_all <= GOAL else 1)


if __name__ == "__main__":
    main()
