"""Writes expected.json: verl's token-level advantage estimators (`verl.trainer.ppo.core_algos`,
verl 0.9.1) on small random batches, in float64, for `tests/verl_agreement.rs` to match.
Run once by hand when the cases change; the tests read the saved numbers (verl and Ray are not
needed to test):

    pip install --target /tmp/verl --no-deps verl==0.9.1 tensordict pyvers cloudpickle orjson
    pip install --target /tmp/verl ray omegaconf codetiming
    PYTHONPATH=/tmp/verl python make_expected.py > expected.json   # torch and numpy from the venv
"""

import json
import sys
from types import SimpleNamespace

import torch
from verl.trainer.ppo import core_algos

torch.manual_seed(0)


def right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths], dtype=torch.float64)


def outcome_rewards(rewards: list[float], lengths: list[int], width: int) -> torch.Tensor:
    """The scalar reward at each response's last token, as verl's reward managers place it."""
    out = torch.zeros(len(rewards), width, dtype=torch.float64)
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        out[i, n - 1] = r
    return out


def rows(t: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    return [t[i, :n].tolist() for i, n in enumerate(lengths)]


cases = []
for case, (lengths, gamma, lam) in enumerate(
    [([3, 5, 1, 4], 1.0, 1.0), ([6, 2, 6, 3, 5], 0.9, 0.95), ([4, 4, 2], 0.99, 0.8)]
):
    width = max(lengths)
    mask = right_padded_mask(lengths, width)
    rewards = [round(float(x), 4) for x in torch.rand(len(lengths)) * 2 - 0.5]
    outcome = outcome_rewards(rewards, lengths, width)
    # Dense per-token rewards too (a KL-in-reward or process reward), for GAE and REINFORCE++.
    dense = (torch.randn(len(lengths), width, dtype=torch.float64) * 0.1 + outcome) * mask
    values = torch.randn(len(lengths), width, dtype=torch.float64) * mask
    config = SimpleNamespace(gamma=gamma)
    rpp_adv, rpp_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(dense, mask, config=config)
    gae_adv, gae_ret = core_algos.compute_gae_advantage_return(dense, values, mask, gamma, lam)
    uids = [i % 2 for i in range(len(lengths))]
    base_adv, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        outcome, mask, index=uids, config=config
    )
    cases.append(
        {
            "lengths": lengths,
            "gamma": gamma,
            "lam": lam,
            "rewards": rewards,
            "uids": uids,
            "token_rewards": rows(dense, lengths),
            "values": rows(values, lengths),
            "reinforce_plus_plus": {"advantages": rows(rpp_adv, lengths), "returns": rows(rpp_ret, lengths)},
            "gae": {"advantages": rows(gae_adv, lengths), "returns": rows(gae_ret, lengths)},
            "reinforce_plus_plus_baseline": {"advantages": rows(base_adv, lengths)},
        }
    )

# Outcome-reward estimators on fixed batches with zero rewards and a group of one (GPG's α
# counts the batch's non-zero rewards).
outcome_cases = []
for lengths, rewards, uids in [
    ([3, 5, 1, 4, 2], [1.0, 0.0, 0.5, 0.0, 2.0], [0, 0, 1, 1, 2]),
    ([2, 2, 6, 3], [0.25, -1.0, 0.0, 0.75], [7, 7, 7, 7]),
]:
    width = max(lengths)
    mask = right_padded_mask(lengths, width)
    outcome = outcome_rewards(rewards, lengths, width)
    opo, _ = core_algos.compute_opo_outcome_advantage(outcome.clone(), mask, index=uids)
    gpg, _ = core_algos.compute_gpg_outcome_advantage(outcome.clone(), mask, index=uids)
    outcome_cases.append(
        {"lengths": lengths, "rewards": rewards, "uids": uids, "opo": rows(opo, lengths), "gpg": rows(gpg, lengths)}
    )

json.dump({"verl": "0.9.1", "cases": cases, "outcome_cases": outcome_cases}, sys.stdout, indent=1)
sys.stdout.write("\n")
