"""Writes rollout_corr.json: verl's rollout correction (`verl.trainer.ppo.rollout_corr_helper`,
verl 0.9.1) on small random batches — IS weights, rejection masks and the `rollout_corr/*`
metrics — for `tests/verl_agreement.rs` to match. Run once by hand when the cases change
(installed as for make_expected.py):

    PYTHONPATH=/tmp/verl python make_rollout_corr.py > rollout_corr.json
"""

import json

import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

torch.manual_seed(1)

# (lengths, spread of the log-ratio, rollout_is, its threshold, rollout_rs, its thresholds)
CASES = [
    ([3, 5, 1, 4], 0.3, "token", 2.0, "token_k1", "0.8_1.25"),
    ([6, 2, 6, 3, 5], 0.2, "sequence", 1.5, "seq_mean_k1", "1.15"),
    ([4, 4, 2, 7], 0.5, "token", "0.6_1.7", "seq_max_k2,token_k3", "0.2,0.05"),
    ([5, 3, 6], 0.1, "sequence", "0.9_1.3", "seq_sum_k2,seq_mean_k3", "0.02,0.003"),
]

METRICS = [
    "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low", "rollout_is_eff_sample_size", "rollout_rs_masked_fraction",
    "rollout_rs_seq_masked_fraction", "kl", "k3_kl", "training_ppl", "rollout_ppl",
    "log_ppl_diff", "chi2_token", "chi2_seq",
]

out = []
for lengths, spread, is_level, is_threshold, rs, rs_threshold in CASES:
    width = max(lengths)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths], dtype=torch.float64)
    # Log-probs as f32 values (what the engine and the trainer hand over), computed on in f64.
    rollout = (-torch.rand(len(lengths), width) * 3.0).to(torch.float32).to(torch.float64)
    old = (rollout + torch.randn(len(lengths), width) * spread).to(torch.float32).to(torch.float64)
    rollout, old = rollout * mask, old * mask
    weights, keep, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old,
        rollout_log_prob=rollout,
        response_mask=mask,
        rollout_is=is_level,
        rollout_is_threshold=is_threshold,
        rollout_rs=rs,
        rollout_rs_threshold=rs_threshold,
    )
    w = weights.batch["rollout_is_weights"]
    rows = lambda t: [t[i, :n].tolist() for i, n in enumerate(lengths)]
    out.append({
        "old": rows(old),
        "rollout": rows(rollout),
        "rollout_is": is_level,
        "rollout_is_threshold": str(is_threshold),
        "rollout_rs": rs,
        "rollout_rs_threshold": rs_threshold,
        "weights": rows(w),
        "keep": rows(keep),
        "metrics": {k: metrics[f"rollout_corr/{k}"] for k in METRICS},
    })
print(json.dumps({"verl": "0.9.1", "cases": out}, indent=1))
