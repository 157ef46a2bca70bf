//! REINFORCE++, REINFORCE++-baseline and GAE against verl's `core_algos` (0.9.1) on small random
//! batches, computed in float64 by `tests/verl/make_expected.py` and saved in
//! `tests/verl/expected.json`: right-padded rows there, rows of their own lengths here.

use oxrl_algo::returns::{gae, reinforce_plus_plus};
use oxrl_algo::{compute_advantages, AdvantageConfig, AdvantageEstimator};
use serde_json::Value;

fn expected() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/verl/expected.json");
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
        let got = compute_advantages(&outcome, &uids, &lens, &cfg);
        let want = rows(&case["reinforce_plus_plus_baseline"]["advantages"]);
        assert_agrees(&format!("case {k} reinforce++-baseline"), &got, &want);
    }
}
