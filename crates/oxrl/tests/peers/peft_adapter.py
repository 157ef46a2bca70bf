"""Makes a LoRA adapter with the real PEFT package, the way a user of the Python stacks would:
`get_peft_model` on the base checkpoint, then `save_pretrained`. `init_lora_weights=False`
draws B as well as A at random (PEFT's default B is zero, which would test nothing).

    python peft_adapter.py BASE_DIR OUT_DIR RANK ALPHA RSLORA(0|1) TARGET[,TARGET...]"""

import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText


def main(base: str, out: str, rank: str, alpha: str, rslora: str, targets: str) -> None:
    torch.manual_seed(0)
    vision = getattr(AutoConfig.from_pretrained(base), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=int(rank),
        lora_alpha=float(alpha),
        use_rslora=rslora == "1",
        target_modules=targets.split(","),
        init_lora_weights=False,
    )
    get_peft_model(model, config).save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:7])
