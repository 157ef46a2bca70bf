//! The bytes a data-parallel rank sends the others after sampling its share of a step: its
//! completions and their rewards. A compact binary form, so every number arrives bit for bit
//! (rewards feed the advantages, which must be equal on every rank).

use crate::update::{Result, TrainError};
use oxrl_reward::RewardOutcome;
use oxrl_rollout::{Completion, EpisodeTokens, FinishReason, WeightVersion};

/// One rank's completions (per prompt, per sample) and their rewards, as bytes.
pub fn encode(completions: &[Vec<Completion>], rewards: &RewardOutcome) -> Vec<u8> {
    let mut w = Writer::default();
    w.len(completions.len());
    for samples in completions {
        w.len(samples.len());
        for c in samples {
            w.len(c.response_ids.len());
            c.response_ids.iter().for_each(|&t| w.u32(t));
            w.len(c.logprobs.len());
            c.logprobs.iter().for_each(|&l| w.u32(l.to_bits()));
            w.u8(match c.finish_reason {
                FinishReason::Stop => 0,
                FinishReason::Length => 1,
            });
            match &c.text {
                Some(text) => {
                    w.u8(1);
                    w.str(text);
                }
                None => w.u8(0),
            }
            w.u64(c.weight_version.0);
            match &c.episode {
                Some(e) => {
                    w.u8(1);
                    match &e.prompt_ids {
                        Some(p) => {
                            w.u8(1);
                            w.len(p.len());
                            p.iter().for_each(|&t| w.u32(t));
                        }
                        None => w.u8(0),
                    }
                    w.len(e.generated.len());
                    e.generated.iter().for_each(|&g| w.u8(u8::from(g)));
                }
                None => w.u8(0),
            }
        }
    }
    w.f64s(&rewards.total);
    w.len(rewards.per_function.len());
    for (name, scores) in &rewards.per_function {
        w.str(name);
        w.f64s(scores);
    }
    w.len(rewards.failures.len());
    for (name, failed) in &rewards.failures {
        w.str(name);
        w.len(*failed);
    }
    w.len(rewards.latency.len());
    for (name, secs) in &rewards.latency {
        w.str(name);
        w.u64(secs.to_bits());
    }
    w.0
}

/// The completions and rewards [`encode`] wrote; `rank` names the sender in errors.
pub fn decode(bytes: &[u8], rank: usize) -> Result<(Vec<Vec<Completion>>, RewardOutcome)> {
    let mut r = Reader { bytes, at: 0, rank };
    let prompts = r.len()?;
    let mut completions = Vec::with_capacity(prompts);
    for _ in 0..prompts {
        let samples = r.len()?;
        let mut group = Vec::with_capacity(samples);
        for _ in 0..samples {
            let n = r.len()?;
            let response_ids = (0..n).map(|_| r.u32()).collect::<Result<_>>()?;
            let n = r.len()?;
            let logprobs = (0..n)
                .map(|_| r.u32().map(f32::from_bits))
                .collect::<Result<_>>()?;
            let finish_reason = match r.u8()? {
                0 => FinishReason::Stop,
                _ => FinishReason::Length,
            };
            let text = match r.u8()? {
                0 => None,
                _ => Some(r.str()?),
            };
            let weight_version = WeightVersion(r.u64()?);
            let episode = match r.u8()? {
                0 => None,
                _ => {
                    let prompt_ids = match r.u8()? {
                        0 => None,
                        _ => Some((0..r.len()?).map(|_| r.u32()).collect::<Result<_>>()?),
                    };
                    let generated = (0..r.len()?)
                        .map(|_| r.u8().map(|g| g != 0))
                        .collect::<Result<_>>()?;
                    Some(EpisodeTokens {
                        prompt_ids,
                        generated,
                    })
                }
            };
            group.push(Completion {
                response_ids,
                logprobs,
                finish_reason,
                text,
                weight_version,
                episode,
            });
        }
        completions.push(group);
    }
    let total = r.f64s()?;
    let per_function = (0..r.len()?)
        .map(|_| Ok((r.str()?, r.f64s()?)))
        .collect::<Result<_>>()?;
    let failures = (0..r.len()?)
        .map(|_| Ok((r.str()?, r.len()?)))
        .collect::<Result<_>>()?;
    let latency = (0..r.len()?)
        .map(|_| Ok((r.str()?, f64::from_bits(r.u64()?))))
        .collect::<Result<_>>()?;
    Ok((
        completions,
        RewardOutcome {
            total,
            per_function,
            failures,
            latency,
        },
    ))
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u64(n as u64);
    }
    fn str(&mut self, s: &str) {
        self.len(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn f64s(&mut self, values: &[f64]) {
        self.len(values.len());
        values.iter().for_each(|v| self.u64(v.to_bits()));
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    rank: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(TrainError::Invalid(format!(
                "rank {}'s share of the step is cut short at byte {} of {}: ranks run different \
                 oxrl versions?",
                self.rank,
                self.at,
                self.bytes.len()
            )));
        };
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn len(&mut self) -> Result<usize> {
        let n = self.u64()?;
        // No count can exceed the bytes that would carry it.
        if n > self.bytes.len() as u64 {
            return self.take(usize::MAX).map(|_| 0);
        }
        Ok(n as usize)
    }
    fn str(&mut self) -> Result<String> {
        let n = self.len()?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn f64s(&mut self) -> Result<Vec<f64>> {
        (0..self.len()?)
            .map(|_| self.u64().map(f64::from_bits))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_round_trips_bit_for_bit() {
        let completions = vec![
            vec![Completion {
                response_ids: vec![1, 2, 151_643],
                logprobs: vec![-0.1, -1e-30, f32::MIN_POSITIVE],
                finish_reason: FinishReason::Length,
                text: Some("x = 1 → ✓".into()),
                weight_version: WeightVersion(7),
                episode: None,
            }],
            vec![],
            vec![Completion {
                response_ids: vec![5, 6, 7],
                logprobs: vec![-0.5, 0.0, -0.25],
                finish_reason: FinishReason::Stop,
                text: None,
                weight_version: WeightVersion(8),
                episode: Some(EpisodeTokens {
                    prompt_ids: Some(vec![9, 10]),
                    generated: vec![true, false, true],
                }),
            }],
        ];
        let rewards = RewardOutcome {
            total: vec![0.1 + 0.2, -0.0],
            per_function: vec![("acc".into(), vec![1.0 / 3.0, 2.0])],
            failures: vec![("acc".into(), 2)],
            latency: vec![("acc".into(), 0.125)],
        };
        let (c, r) = decode(&encode(&completions, &rewards), 1).unwrap();
        assert_eq!(c, completions);
        assert_eq!(r.total[0].to_bits(), (0.1f64 + 0.2).to_bits());
        assert_eq!(r.total[1].to_bits(), (-0.0f64).to_bits());
        assert_eq!(r.per_function, rewards.per_function);
        assert_eq!(r.failures, rewards.failures);
        assert_eq!(r.latency, rewards.latency);
        let bytes = encode(&completions, &rewards);
        let err = decode(&bytes[..bytes.len() - 3], 3)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 3's share") && err.contains("cut short"),
            "{err}"
        );
    }
}
