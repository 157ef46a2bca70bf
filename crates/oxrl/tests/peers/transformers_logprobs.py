"""Loads a checkpoint directory that oxrl wrote, with transformers' Auto classes, and prints the
log-probability of each response token given its prompt: one JSON line per JSON line of stdin
({"prompt": text, "response": text}). Float32, eager attention, CPU: the reference numerics."""

import json
import sys

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)


def main(model_dir: str) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    vision = getattr(config, "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for line in sys.stdin:
        case = json.loads(line)
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
    main(sys.argv[1])
