//! REINFORCE++, REINFORCE++-baseline and GAE against verl's `core_algos` (0.9.1) on small random
//! batches, computed in float64 by `tests/verl/make_expected.py` and saved in
//! `tests/verl/expected.json`: right-padded rows there, rows of their own lengths here. Rollout
//! correction against verl's `rollout_corr_helper` likewise (`make_rollout_corr.py`,
//! `rollout_corr.json`).

use oxrl_algo::returns::{gae, reinforce_plus_plus};
use oxrl_algo::{compute_advantages, AdvantageConfig, AdvantageEstimator};
use serde_json::Value;

fn expected() -> Value {
    saved(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/verl/expected.json"
    ))
}

fn saved(path: &str) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

fn assert_agrees(what: &str, got: &[Vec<f64>], want: &[Vec<f64>]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "{what}");
        for (a, b) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-12 * (1.0 + b.abs()),
                "{what}: {a} vs verl's {b}"
            );
        }
    }
}

#[test]
fn token_level_estimators_match_verl() {
    let cases = expected()["cases"].as_array().unwrap().clone();
    assert!(!cases.is_empty());
    for (k, case) in cases.iter().enumerate() {
        let gamma = case["gamma"].as_f64().unwrap();
        let lam = case["lam"].as_f64().unwrap();
        let rewards = rows(&case["token_rewards"]);
        let values = rows(&case["values"]);

        let rpp = reinforce_plus_plus(&rewards, gamma);
        let want = &case["reinforce_plus_plus"];
        assert_agrees(
            &format!("case {k} reinforce++ returns"),
            &rpp.returns,
            &rows(&want["returns"]),
        );
        assert_agrees(
            &format!("case {k} reinforce++"),
            &rpp.advantages,
            &rows(&want["advantages"]),
        );

        let g = gae(&rewards, &values, gamma, lam);
        let want = &case["gae"];
        assert_agrees(
            &format!("case {k} gae returns"),
            &g.returns,
            &rows(&want["returns"]),
        );
        assert_agrees(
            &format!("case {k} gae"),
            &g.advantages,
            &rows(&want["advantages"]),
        );

        // The baseline variant from outcome rewards, grouped by uid, through the registry.
        let outcome: Vec<f64> = case["rewards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let uids: Vec<u64> = case["uids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let lens: Vec<usize> = case["lengths"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::from_name("reinforce_plus_plus_baseline").unwrap(),
            ..Default::default()
        };
        let got = compute_advantages(&outcome, &uids, &lens, &cfg).unwrap();
        let want = rows(&case["reinforce_plus_plus_baseline"]["advantages"]);
        assert_agrees(&format!("case {k} reinforce++-baseline"), &got, &want);
    }
}

/// IS weights (token and sequence level, truncated and IcePop), rejection masks (token,
/// geometric-mean, sequence max/sum/mean, chained) and the `rollout_corr/*` metrics equal verl's.
/// verl reduces its metrics through float32 (`.float().mean()`), hence 1e-6 there.
#[test]
fn rollout_correction_matches_verl() {
    use oxrl_algo::rollout_corr::{rollout_correction, IsConfig, RejectRule};
    let data = saved(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/verl/rollout_corr.json"
    ));
    let cases = data["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    let f32_rows = |v: &Value| -> Vec<Vec<f32>> {
        rows(v)
            .iter()
            .map(|r| r.iter().map(|&x| x as f32).collect())
            .collect()
    };
    for (i, case) in cases.iter().enumerate() {
        let (old, rollout) = (f32_rows(&case["old"]), f32_rows(&case["rollout"]));
        // The saved values are f32 numbers (serde_json may parse them an f64 ulp away; the f32
        // they round to is the one verl used).
        for (a, b) in old.iter().flatten().zip(rows(&case["old"]).concat()) {
            assert!((*a as f64 - b).abs() <= 1e-15 * b.abs(), "{a} vs {b}");
        }
        let is = IsConfig::parse(
            case["rollout_is"].as_str().unwrap(),
            case["rollout_is_threshold"].as_str().unwrap(),
        )
        .unwrap();
        let names = case["rollout_rs"].as_str().unwrap().split(',');
        let thresholds = case["rollout_rs_threshold"].as_str().unwrap().split(',');
        let rules: Vec<RejectRule> = names
            .zip(thresholds)
            .map(|(n, t)| RejectRule::parse(n, t).unwrap())
            .collect();
        let c = rollout_correction(&old, &rollout, Some(&is), &rules);
        assert_agrees(
            &format!("case {i} weights"),
            c.weights.as_ref().unwrap(),
            &rows(&case["weights"]),
        );
        let keep: Vec<Vec<f64>> = c
            .keep
            .unwrap()
            .iter()
            .map(|r| r.iter().map(|&k| k as u8 as f64).collect())
            .collect();
        assert_eq!(keep, rows(&case["keep"]), "case {i} keep");
        for (name, want) in case["metrics"].as_object().unwrap() {
            let want = want.as_f64().unwrap();
            let got = c.metrics[&format!("rollout_corr/{name}")];
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "case {i} {name}: {got} vs verl's {want}"
            );
        }
    }
}

/// OPO and GPG from outcome rewards (with zero rewards and a group of one) equal verl's. verl
/// takes GPG's α = B / #nonzero as a float32 tensor, so GPG agrees to its rounding (1e-7).
#[test]
fn opo_and_gpg_match_verl() {
    let data = expected();
    let cases = data["outcome_cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for (k, case) in cases.iter().enumerate() {
        let rewards: Vec<f64> = case["rewards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let uids: Vec<u64> = case["uids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let lens: Vec<usize> = case["lengths"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        for (name, rel) in [("opo", 1e-12), ("gpg", 1e-7)] {
            let cfg = AdvantageConfig {
                estimator: AdvantageEstimator::from_name(name).unwrap(),
                ..Default::default()
            };
            let got = compute_advantages(&rewards, &uids, &lens, &cfg).unwrap();
            let want = rows(&case[name]);
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!(
                    (g - w).abs() <= rel * (1.0 + w.abs()),
                    "case {k} {name}: {g} vs verl's {w}"
                );
            }
            assert_eq!(got.iter().flatten().count(), want.iter().flatten().count());
        }
    }
}
