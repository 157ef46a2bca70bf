"""Runs an ONNX model that `oxrl export --format onnx` wrote, with onnxruntime, the way a
deployment does: full forwards for log-probs, greedy decoding through the KV cache
(`present.*` fed back as `past_key_values.*`), and a left-padded batch.

stdin: {"model": DIR, "logits_ids": [...], "cases": [{"prompt_ids", "response_ids"}],
        "greedy": [{"prompt_ids", "max_new_tokens"}], "batch_new_tokens": N}
stdout: {"logits": [[...]], "logprobs": [[...]], "greedy": [[...]], "batch_greedy": [[...]]}
"""
import json
import sys

import numpy as np
import onnxruntime as ort


class Decoder:
    def __init__(self, model_dir):
        self.session = ort.InferenceSession(
            f"{model_dir}/model.onnx", providers=["CPUExecutionProvider"]
        )
        self.past_inputs = [
            i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")
        ]

    def empty_past(self, batch):
        return {
            i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
            for i in self.past_inputs
        }

    def run(self, ids, mask, positions, past):
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}
        outputs = self.session.run(None, feed)
        names = [o.name for o in self.session.get_outputs()]
        logits = outputs[names.index("logits")]
        present = {
            n.replace("present.", "past_key_values."): v
            for n, v in zip(names, outputs)
            if n.startswith("present.")
        }
        return logits, present

    def forward(self, ids):
        ids = np.array([ids], np.int64)
        t = ids.shape[1]
        logits, _ = self.run(
            ids, np.ones((1, t), np.int64), np.arange(t)[None], self.empty_past(1)
        )
        return logits[0]

    def greedy(self, prompts, new_tokens):
        """Greedy continuations of left-padded `prompts`, one cached step per token."""
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = np.array([[0] * (width - len(p)) + p for p in prompts], np.int64)
        mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts], np.int64)
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        logits, past = self.run(ids, mask, positions, self.empty_past(len(prompts)))
        out = [[] for _ in prompts]
        for _ in range(new_tokens):
            nxt = logits[:, -1].argmax(-1)
            for row, token in zip(out, nxt):
                row.append(int(token))
            mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
            positions = positions[:, -1:] + 1
            logits, past = self.run(nxt[:, None].astype(np.int64), mask, positions, past)
        return out


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main():
    req = json.load(sys.stdin)
    dec = Decoder(req["model"])
    result = {"logits": dec.forward(req["logits_ids"]).tolist()}
    result["logprobs"] = []
    for case in req["cases"]:
        p, r = case["prompt_ids"], case["response_ids"]
        lp = log_softmax(dec.forward(p + r))
        result["logprobs"].append([float(lp[len(p) - 1 + i, t]) for i, t in enumerate(r)])
    result["greedy"] = [dec.greedy([g["prompt_ids"]], g["max_new_tokens"])[0] for g in req["greedy"]]
    prompts = [g["prompt_ids"] for g in req["greedy"]]
    result["batch_greedy"] = dec.greedy(prompts, req["batch_new_tokens"])
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
