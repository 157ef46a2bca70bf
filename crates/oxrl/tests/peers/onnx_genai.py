"""Generates from an `oxrl export --format onnx` directory with onnxruntime-genai, as a user
deploys it: `og.Model(dir)` reads the export's genai_config.json, `og.Tokenizer` its
tokenizer files and chat template, and the generator decodes greedily through the KV cache,
stopping at an end token (reported with the answer: the generator's sequence leaves it out);
then the same prompts as one batch, padded as its tokenizer pads them.

stdin: {"model": DIR, "questions": [text], "max_new_tokens": N}
stdout: {"results": [{"prompt", "prompt_ids", "new_ids", "text"}] per question,
         "batch": [new ids] per question, decoded together}
"""
import json
import sys

import numpy as np
import onnxruntime_genai as og


def greedy(model, config, tokens, max_new_tokens):
    """Each row's new ids up to its first end token. `tokens` is one prompt's ids, or
    `Tokenizer.encode_batch`'s padded batch (onnxruntime-genai pads on the right and starts
    each row's answer at its own end)."""
    tokens = np.asarray(tokens, dtype=np.int32).reshape(-1, np.shape(tokens)[-1])
    params = og.GeneratorParams(model)
    params.set_search_options(
        do_sample=False, max_length=tokens.shape[1] + max_new_tokens, batch_size=tokens.shape[0]
    )
    generator = og.Generator(model, params)
    generator.append_tokens(tokens)
    # Each step's tokens, the end token included (the sequence leaves out the one it stops at).
    steps = []
    while not generator.is_done():
        generator.generate_next_token()
        steps.append([int(t) for t in generator.get_next_tokens()])
    eos = set(config["model"]["eos_token_id"])
    out = []
    for row in range(tokens.shape[0]):
        new = [step[row] for step in steps]
        ends = [i for i, t in enumerate(new) if t in eos]
        out.append(new[: ends[0] + 1] if ends else new)
    return out


def main(request):
    model = og.Model(request["model"])
    with open(f"{request['model']}/genai_config.json") as f:
        config = json.load(f)
    tokenizer = og.Tokenizer(model)
    n = request["max_new_tokens"]
    results = []
    texts = []
    for question in request["questions"]:
        messages = json.dumps([{"role": "user", "content": question}])
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = [int(t) for t in tokenizer.encode(prompt)]
        new = greedy(model, config, [ids], n)[0]
        texts.append(prompt)
        results.append(
            {"prompt": prompt, "prompt_ids": ids, "new_ids": new, "text": tokenizer.decode(new)}
        )
    batch = tokenizer.encode_batch(texts).as_numpy()
    return {"results": results, "batch": greedy(model, config, batch, n)}


if __name__ == "__main__":
    json.dump(main(json.load(sys.stdin)), sys.stdout)
