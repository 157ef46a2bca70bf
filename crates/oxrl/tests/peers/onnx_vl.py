"""Runs a Qwen3-VL ONNX export (`vision.onnx` and `model.onnx` from `oxrl export --format
onnx`) with onnxruntime the way a deployment does: the vision graph once per image on the
image processor's pixel rows, its embeddings and DeepStack features fed to the decoder with
MRoPE positions, then greedy decoding through the KV cache (new tokens continue every position
row from max + 1).

stdin: {"model": DIR, "pixel_values": [[...]], "grids": [[t, h, w], ...], "input_ids": [...],
        "position_ids": [[...], [...], [...]], "max_new_tokens": N}
stdout: {"image_embeds", "deepstack_embeds", "logits", "greedy"}
"""
import json
import sys

import numpy as np
import onnxruntime as ort


def main():
    req = json.load(sys.stdin)
    cpu = ["CPUExecutionProvider"]
    vision = ort.InferenceSession(f"{req['model']}/vision.onnx", providers=cpu)
    decoder = ort.InferenceSession(f"{req['model']}/model.onnx", providers=cpu)
    pixels = np.array(req["pixel_values"], np.float32)
    embeds, deepstack, start = [], [], 0
    for grid in req["grids"]:
        n = int(np.prod(grid))
        e, d = vision.run(
            None,
            {"pixel_values": pixels[start : start + n], "grid_thw": np.array(grid, np.int64)},
        )
        embeds.append(e)
        deepstack.append(d)
        start += n
    embeds = np.concatenate(embeds)
    deepstack = np.concatenate(deepstack, axis=1)

    ids = np.array([req["input_ids"]], np.int64)
    positions = np.array(req["position_ids"], np.int64)[:, None, :]
    mask = np.ones_like(ids)
    past = {
        i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        for i in decoder.get_inputs()
        if i.name.startswith("past_key_values.")
    }
    names = [o.name for o in decoder.get_outputs()]
    feed = {"image_embeds": embeds, "deepstack_embeds": deepstack}
    first_logits, greedy = None, []
    nxt = positions.max() + 1
    for _ in range(req["max_new_tokens"] + 1):
        out = dict(
            zip(
                names,
                decoder.run(
                    None,
                    {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                     **feed, **past},
                ),
            )
        )
        if first_logits is None:
            first_logits = out["logits"][0]
        token = int(out["logits"][0, -1].argmax())
        greedy.append(token)
        ids = np.array([[token]], np.int64)
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
        positions = np.full((3, 1, 1), nxt, np.int64)
        nxt += 1
        # Decode steps carry no image tokens.
        feed = {
            "image_embeds": np.zeros((0, embeds.shape[1]), np.float32),
            "deepstack_embeds": np.zeros((deepstack.shape[0], 0, embeds.shape[1]), np.float32),
        }
        past = {
            n.replace("present.", "past_key_values."): v
            for n, v in out.items()
            if n.startswith("present.")
        }
    json.dump(
        {
            "image_embeds": embeds.tolist(),
            "deepstack_embeds": deepstack.tolist(),
            "logits": first_logits.tolist(),
            "greedy": greedy[: req["max_new_tokens"]],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
