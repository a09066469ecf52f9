"""The SmolLM2 GGUF reference: transformers' own GGUF loader's logits and greedy chat turn.

Run once, offline, where torch, transformers, accelerate and gguf are installed (none of
them is a dependency of this project; CI reads only the JSON this writes):

    python tests/hf_reference/make_gguf_reference.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

transformers dequantizes the file with its own code and runs its own Llama in float32, so
the fixture checks this project's whole GGUF path (names, the Q/K un-permutation, the
tokenizer, the model) against an implementation it shares nothing with. Per text it keeps
the token ids, and at every position the 8 largest logits with their token ids; for the
chat turn, the prompt's ids, the greedy continuation and, per generated token, the margin
between the best and second-best logit (a tie would make the greedy comparison fragile).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TEXTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "The capital of France is Paris. The capital of Italy is Rome. 12345 + 678 = ",
    "Q: What do bees make?\nA: Honey, which they store in wax combs.",
]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TOP = 8
NEW_TOKENS = 24


def main(gguf: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    texts = []
    with torch.no_grad():
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            logits = model(torch.tensor([ids])).logits[0]
            values, indices = logits.topk(TOP, dim=-1)
            texts.append({"text": text, "ids": ids, "top_ids": indices.tolist(),
                          "top_values": [[round(v, 5) for v in row] for row in values.tolist()],
                          "max_abs": float(logits.abs().max())})
        prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
        new = out.sequences[0, len(prompt_ids):].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    eos = tok.eos_token_id
    text_ids = new[:new.index(eos)] if eos in new else new
    reference = {
        "source": f"transformers {__import__('transformers').__version__} GGUF loader, "
                  f"torch {torch.__version__}, float32, from {path.name}",
        "texts": texts,
        "chat": {"messages": CHAT, "prompt": prompt, "prompt_ids": prompt_ids,
                 "new_ids": new, "text": tok.decode(text_ids, skip_special_tokens=True),
                 "margins": [round(m, 4) for m in margins]},
    }
    out_file = Path(__file__).with_name("smollm2-gguf") / "reference.json"
    out_file.parent.mkdir(exist_ok=True)
    out_file.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {out_file}; chat reply {reference['chat']['text']!r}, smallest margin "
          f"{min(margins):.4f}")


if __name__ == "__main__":
    main(sys.argv[1])
