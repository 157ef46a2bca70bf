"""Loads a checkpoint directory that oxrl wrote, with transformers' Auto classes, and prints the
log-probability of each response token given its prompt: one JSON line per JSON line of stdin
({"prompt": text, "response": text} or {"prompt_ids": [...], "response_ids": [...]}). Eager
attention on the CPU, in float32 (the reference numerics) or the dtype named by the second
argument (bfloat16); the log-softmax is taken in float32 either way. With a third argument, the
PEFT adapter in that directory is applied first (`PeftModel.from_pretrained`).

    python transformers_logprobs.py MODEL_DIR [float32|bfloat16 [ADAPTER_DIR]] < cases.jsonl"""

import json
import sys

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)


def main(model_dir: str, dtype: str, adapter: str | None) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    vision = getattr(config, "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
    ).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    tokenizer = None
    for line in sys.stdin:
        case = json.loads(line)
        if "prompt_ids" in case:
            prompt, response = case["prompt_ids"], case["response_ids"]
        else:
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
            prompt = tokenizer.encode(case["prompt"], add_special_tokens=False)
            response = tokenizer.encode(case["response"], add_special_tokens=False)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        scored = [
            logprobs[len(prompt) - 1 + i, token].item()
            for i, token in enumerate(response)
        ]
        print(
            json.dumps(
                {
                    "class": type(model).__name__,
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "logprobs": scored,
                }
            )
        )


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2] if len(sys.argv) > 2 else "float32",
        sys.argv[3] if len(sys.argv) > 3 else None,
    )
