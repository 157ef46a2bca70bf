//! `--set section.key=value`: a configuration key changed from the command line (as Hydra's
//! `key=value` overrides do in verl), by editing the TOML text itself, so the file's comments,
//! its other lines and its relative paths stay as they were, and the run directory keeps the
//! configuration it actually ran.

use std::fmt;
use std::str::FromStr;

/// One `section.key=value` (or a top-level `key=value`).
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub section: Option<String>,
    pub key: String,
    /// The value as TOML: numbers, booleans, arrays and quoted strings as given; any other
    /// text becomes a string.
    pub value: String,
}

impl FromStr for Override {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (path, raw) = s
            .split_once('=')
            .ok_or_else(|| format!("`{s}`: expected section.key=value (e.g. trainer.lr=1e-5)"))?;
        let path = path.trim();
        let (section, key) = match path.split_once('.') {
            Some((section, key)) => (Some(section.to_string()), key.to_string()),
            None => (None, path.to_string()),
        };
        let bare = |k: &str| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if !bare(&key) || !section.as_deref().is_none_or(bare) {
            return Err(format!(
                "`{path}`: expected section.key or key (a key inside a [[reward.functions]] \
                 table is changed in the file)"
            ));
        }
        let raw = raw.trim();
        let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
            Ok(_) => raw.to_string(),
            Err(_) => toml::Value::String(raw.to_string()).to_string(),
        };
        Ok(Self {
            section,
            key,
            value,
        })
    }
}

impl fmt::Display for Override {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match &self.section {
            Some(section) => write!(f, "{section}.{}={}", self.key, self.value),
            None => write!(f, "{}={}", self.key, self.value),
        }
    }
}

/// The table header a line opens (`[trainer]` → `trainer`), if it is one.
fn header(line: &str) -> Option<&str> {
    let line = line.trim();
    let line = line.split('#').next().unwrap_or("").trim_end();
    let inner = line.strip_prefix('[')?.strip_suffix(']')?;
    Some(inner.trim_matches(|c| c == '[' || c == ']').trim())
}

/// `text` with each override applied: an existing `key = ...` line in the section is replaced,
/// a missing key is added under its section's header, a missing section is appended.
pub fn apply(text: &str, overrides: &[Override]) -> Result<String, String> {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    for o in overrides {
        let line = format!("{} = {}", o.key, o.value);
        let mut current: Option<&str> = None;
        let mut found = None;
        let mut section_start = None;
        for (i, l) in lines.iter().enumerate() {
            if let Some(h) = header(l) {
                current = Some(h);
                if Some(h) == o.section.as_deref() && section_start.is_none() {
                    section_start = Some(i + 1);
                }
                continue;
            }
            let assigns = l
                .trim_start()
                .strip_prefix(o.key.as_str())
                .is_some_and(|rest| rest.trim_start().starts_with('='));
            if assigns && current == o.section.as_deref() {
                found = Some(i);
                break;
            }
        }
        match (found, o.section.as_deref(), section_start) {
            (Some(i), _, _) => {
                if toml::from_str::<toml::Table>(lines[i].trim()).is_err() {
                    return Err(format!(
                        "{o}: `{}` spans several lines; change it in the file",
                        lines[i].trim()
                    ));
                }
                lines[i] = line;
            }
            (None, None, _) => lines.insert(0, line),
            (None, Some(_), Some(start)) => lines.insert(start, line),
            (None, Some(section), None) => {
                lines.push(String::new());
                lines.push(format!("[{section}]"));
                lines.push(line);
            }
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(items: &[&str]) -> Vec<Override> {
        items.iter().map(|s| s.parse().unwrap()).collect()
    }

    const TEXT: &str =
        "# demo\n[model]\npath = \"policy\" # local\n\n[trainer]\nlr = 1e-3\nseed = 1\n";

    #[test]
    fn an_existing_key_is_replaced_in_its_section_and_comments_stay() {
        let out = apply(TEXT, &set(&["trainer.lr=3e-4", "model.path=other"])).unwrap();
        assert_eq!(
            out,
            "# demo\n[model]\npath = \"other\"\n\n[trainer]\nlr = 3e-4\nseed = 1\n"
        );
    }

    #[test]
    fn a_missing_key_goes_under_its_header_and_a_missing_section_at_the_end() {
        let out = apply(
            TEXT,
            &set(&["trainer.save_every=5", "algorithm.kl_coef=0.01"]),
        )
        .unwrap();
        assert_eq!(
            out,
            "# demo\n[model]\npath = \"policy\" # local\n\n[trainer]\nsave_every = 5\nlr = 1e-3\n\
             seed = 1\n\n[algorithm]\nkl_coef = 0.01\n"
        );
        let table: toml::Table = toml::from_str(&out).unwrap();
        assert_eq!(table["algorithm"]["kl_coef"].as_float(), Some(0.01));
    }

    #[test]
    fn values_are_toml_and_other_text_is_a_string() {
        let o: Override = "algorithm.advantage=rloo".parse().unwrap();
        assert_eq!(o.value, "\"rloo\"");
        let o: Override = "trainer.async=\"one_step\"".parse().unwrap();
        assert_eq!(o.value, "\"one_step\"");
        let o: Override = "rollout.stop=[\"a\", \"b\"]".parse().unwrap();
        assert_eq!(o.value, "[\"a\", \"b\"]");
        assert!("trainer.lr".parse::<Override>().is_err());
        let err = "reward.functions.0.name=x".parse::<Override>().unwrap_err();
        assert!(err.contains("[[reward.functions]]"), "{err}");
    }

    #[test]
    fn a_key_of_another_section_is_not_touched() {
        let text = "[rollout]\nseed = 3\n[trainer]\nlr = 1\n";
        let out = apply(text, &set(&["trainer.seed=9"])).unwrap();
        assert_eq!(out, "[rollout]\nseed = 3\n[trainer]\nseed = 9\nlr = 1\n");
    }

    #[test]
    fn a_multi_line_value_is_refused() {
        let text = "[data]\ntrain_files = [\n  \"a\",\n]\n";
        let err = apply(text, &set(&["data.train_files=b"])).unwrap_err();
        assert!(err.contains("spans several lines"), "{err}");
    }
}
