//! DAPO's sampling-side pieces (Yu et al., 2025, *DAPO: An Open-Source LLM Reinforcement
//! Learning System at Scale*, arXiv:2503.14476): the soft overlong punishment added to a
//! response's reward, and which groups dynamic sampling keeps. (Clip-higher and token-mean
//! aggregation are settings of the policy loss; overlong filtering drops truncated responses
//! from the update.)

use std::collections::HashMap;

/// Soft overlong punishment: 0 up to `max_len − buffer` tokens, then falling linearly to
/// `−factor` at `max_len` (verl's `overlong_buffer`: `min(−(len − (max_len − buffer)) / buffer
/// · factor, 0)`). No buffer, no punishment.
pub fn soft_overlong_penalty(len: usize, max_len: usize, buffer: usize, factor: f64) -> f64 {
    if buffer == 0 {
        return 0.0;
    }
    let expected = max_len.saturating_sub(buffer) as f64;
    let exceed = len as f64 - expected;
    (-exceed / buffer as f64 * factor).min(0.0)
}

/// For each response, whether dynamic sampling keeps its group: the group's rewards are not
/// all equal (they carry a learning signal), or the group has one response (verl keeps those).
pub fn informative_groups<G: Eq + std::hash::Hash>(rewards: &[f64], uids: &[G]) -> Vec<bool> {
    let mut spread: HashMap<&G, (f64, f64, usize)> = HashMap::new();
    for (r, u) in rewards.iter().zip(uids) {
        let e = spread
            .entry(u)
            .or_insert((f64::INFINITY, f64::NEG_INFINITY, 0));
        *e = (e.0.min(*r), e.1.max(*r), e.2 + 1);
    }
    uids.iter()
        .map(|u| {
            let (lo, hi, n) = spread[u];
            n == 1 || hi > lo
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_penalty_falls_linearly_over_the_buffer() {
        // max 100, buffer 20, factor 1: free up to 80 tokens, −0.5 at 90, −1 at 100.
        assert_eq!(soft_overlong_penalty(50, 100, 20, 1.0), 0.0);
        assert_eq!(soft_overlong_penalty(80, 100, 20, 1.0), 0.0);
        assert_eq!(soft_overlong_penalty(90, 100, 20, 1.0), -0.5);
        assert_eq!(soft_overlong_penalty(100, 100, 20, 1.0), -1.0);
        assert_eq!(soft_overlong_penalty(95, 100, 20, 2.0), -1.5);
        assert_eq!(soft_overlong_penalty(100, 100, 0, 1.0), 0.0);
    }

    #[test]
    fn groups_whose_rewards_all_tie_are_dropped() {
        let keep = informative_groups(&[1.0, 1.0, 0.0, 1.0, 0.5], &["a", "a", "b", "b", "c"]);
        assert_eq!(keep, [false, false, true, true, true]);
    }
}
