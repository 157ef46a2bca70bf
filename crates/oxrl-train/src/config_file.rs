//! Reading a run config file against the key catalogue ([`crate::config_keys::KEYS`]): every key
//! is looked up (an unknown one names the closest valid key), its value checked against the
//! key's kind, and its line recorded, so that the resolver reads typed values (or the
//! catalogue's defaults) and reports any later problem at the right line.

use crate::config_keys::{
    function_keys_of, keys_in, preset, preset_names, quoted_alternatives, reward_types, sections,
    spec, KeyDefault, KeySpec, Kind, Range, KEYS,
};
use crate::reward_config::FunctionTable;
use std::collections::HashMap;
use std::path::Path;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

/// A config file that cannot be read, or a problem at one of its lines.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: {source}", .path.display())]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    At {
        path: String,
        line: usize,
        message: String,
    },
}

/// A value type the resolver reads; the key's [`Kind`] check has already passed, so `None`
/// only means a catalogue entry whose kind does not fit the type it is read as.
pub(crate) trait FromToml: Sized {
    fn from_toml(v: &toml::Value) -> Option<Self>;
}

impl FromToml for bool {
    fn from_toml(v: &toml::Value) -> Option<Self> {
        v.as_bool()
    }
}

impl FromToml for String {
    fn from_toml(v: &toml::Value) -> Option<Self> {
        v.as_str().map(str::to_string)
    }
}

impl FromToml for f64 {
    fn from_toml(v: &toml::Value) -> Option<Self> {
        v.as_float().or_else(|| v.as_integer().map(|i| i as f64))
    }
}

macro_rules! integer_from_toml {
    ($($t:ty),*) => {$(
        impl FromToml for $t {
            fn from_toml(v: &toml::Value) -> Option<Self> {
                v.as_integer().and_then(|i| <$t>::try_from(i).ok())
            }
        }
    )*};
}
integer_from_toml!(usize, u64, u32, u16);

/// A list of strings, or one string as a list of one (`train_files = "a.jsonl"`).
impl FromToml for Vec<String> {
    fn from_toml(v: &toml::Value) -> Option<Self> {
        match v {
            toml::Value::String(s) => Some(vec![s.clone()]),
            toml::Value::Array(a) => a.iter().map(String::from_toml).collect(),
            _ => None,
        }
    }
}

impl FromToml for (f64, f64) {
    fn from_toml(v: &toml::Value) -> Option<Self> {
        match v.as_array()?.as_slice() {
            [a, b] => Some((f64::from_toml(a)?, f64::from_toml(b)?)),
            _ => None,
        }
    }
}

/// The catalogue default of `spec` as a value, when it has one.
pub(crate) fn default_value(spec: &KeySpec) -> Option<toml::Value> {
    match spec.default {
        KeyDefault::Value(text) => parse_value(text),
        KeyDefault::Text(_) | KeyDefault::Shown(_) => None,
    }
}

/// A TOML value written on its own (`1e-6`, `"f32"`, `[0.9, 0.999]`).
pub(crate) fn parse_value(text: &str) -> Option<toml::Value> {
    let mut table: toml::Table = toml::from_str(&format!("v = {text}")).ok()?;
    table.remove("v")
}

/// How a value reads in a message: strings quoted, lists and tables by what they are.
fn describe(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("\"{s}\""),
        toml::Value::Array(_) => "a list".into(),
        toml::Value::Table(_) => "a table".into(),
        other => other.to_string(),
    }
}

/// Checks `v` against `kind`; the error says what was expected.
pub(crate) fn check(kind: &Kind, v: &toml::Value) -> Result<(), String> {
    let got = describe(v);
    let number = f64::from_toml(v);
    match kind {
        Kind::Bool if v.is_bool() => Ok(()),
        Kind::Bool => Err(format!("expected true or false, got {got}")),
        Kind::Int { min, max } => match v.as_integer() {
            None => Err(format!("expected an integer, got {got}")),
            Some(i) if i < *min => Err(format!("expected at least {min}, got {i}")),
            Some(i) if i > *max => Err(format!("expected at most {max}, got {i}")),
            Some(_) => Ok(()),
        },
        Kind::Float(range) => match number {
            None => Err(format!("expected a number, got {got}")),
            Some(x) if !range.contains(x) => {
                Err(format!("expected {}, got {x}", range_words(*range)))
            }
            Some(_) => Ok(()),
        },
        Kind::Str if v.is_str() => Ok(()),
        Kind::Str => Err(format!("expected a string, got {got}")),
        Kind::OneOf(_) => {
            let names = kind.names();
            match v.as_str() {
                Some(s) if names.contains(&s) => Ok(()),
                Some(s) => {
                    let hint = match closest(s, names.iter().copied()) {
                        Some(c) => format!("; did you mean \"{c}\"?"),
                        None => String::new(),
                    };
                    Err(format!(
                        "expected {}, got \"{s}\"{hint}",
                        quoted_alternatives(&names)
                    ))
                }
                None => Err(format!(
                    "expected {}, got {got}",
                    quoted_alternatives(&names)
                )),
            }
        }
        Kind::Strings => match v.as_array() {
            Some(a) if a.iter().all(toml::Value::is_str) => Ok(()),
            _ => Err(format!("expected a list of strings, got {got}")),
        },
        Kind::Paths => match Vec::<String>::from_toml(v) {
            Some(_) => Ok(()),
            None => Err(format!("expected a path or a list of paths, got {got}")),
        },
        Kind::Names => match Vec::<String>::from_toml(v) {
            Some(_) => Ok(()),
            None => Err(format!("expected a name or a list of names, got {got}")),
        },
        Kind::Pair(range) => match <(f64, f64)>::from_toml(v) {
            Some((a, b)) if range.contains(a) && range.contains(b) => Ok(()),
            _ => Err(format!("expected two numbers{}", range.describe())),
        },
        Kind::Tables => match v.as_array() {
            Some(a) if a.iter().all(toml::Value::is_table) => Ok(()),
            _ => Err("expected [[reward.functions]] tables".into()),
        },
        Kind::Preset => match v.as_str() {
            Some(s) if preset(s).is_some() => Ok(()),
            _ => {
                let names = preset_names();
                let (last, rest) = names.split_last().unwrap_or((&"", &[]));
                Err(format!(
                    "unknown algorithm {got}; expected {} or {last}",
                    rest.join(", ")
                ))
            }
        },
    }
}

fn range_words(range: Range) -> String {
    match range {
        Range::Any | Range::Finite => "a number".into(),
        Range::NonNegative => "a non-negative number".into(),
        Range::Positive => "a positive number".into(),
        Range::AboveOne => "a number above 1".into(),
        r => format!("a number{}", r.describe()),
    }
}

/// 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The valid name nearest to `name`, if any is near enough to be a likely typo.
pub(crate) fn closest<'a>(
    name: &str,
    candidates: impl Iterator<Item = &'a str>,
) -> Option<&'a str> {
    candidates
        .map(|c| (edit_distance(name, c), c))
        .filter(|(d, c)| *d <= (c.len().max(name.len()) / 3).max(2))
        .min()
        .map(|(_, c)| c)
}

/// A config file read against the catalogue: every value it sets (a preset's included),
/// checked, with the line of each key, section and function table.
pub(crate) struct Given<'a> {
    pub path: &'a Path,
    pub text: &'a str,
    /// `trainer.lr`, `trainer`, `reward.functions.0`, `reward.functions.0.url` → line.
    lines: HashMap<String, usize>,
    /// Dotted key (`trainer.lr`, top-level `policy_model`) → its checked value.
    values: HashMap<String, toml::Value>,
    /// The `[[reward.functions]]` tables, checked against their type.
    pub functions: Vec<FunctionTable>,
}

impl<'a> Given<'a> {
    /// Parses `text` (the contents of `path`) and checks every key against the catalogue.
    pub fn read(text: &'a str, path: &'a Path) -> Result<Self, ConfigError> {
        let mut given = Given {
            path,
            text,
            lines: HashMap::new(),
            values: HashMap::new(),
            functions: Vec::new(),
        };
        let parse_err = |e: toml::de::Error| {
            let line = e.span().map_or(1, |s| line_of(text, s.start));
            given_err(path, line, e.message().trim().to_string())
        };
        let spans = DeTable::parse(text).map_err(parse_err)?;
        let values: toml::Table = toml::from_str(text).map_err(parse_err)?;
        given.walk(&spans, &values)?;
        Ok(given)
    }

    pub fn err(&self, line: usize, message: String) -> ConfigError {
        given_err(self.path, line, message)
    }

    /// The line of `dotted` (e.g. `trainer.lr`), or of its section, or 1.
    pub fn line(&self, dotted: &str) -> usize {
        let section = dotted.split('.').next().unwrap_or_default();
        self.lines
            .get(dotted)
            .or_else(|| self.lines.get(section))
            .copied()
            .unwrap_or(1)
    }

    /// A bad value of `dotted`, at its line.
    pub fn bad(&self, dotted: &str, expected: impl std::fmt::Display) -> ConfigError {
        self.err(self.line(dotted), format!("key `{dotted}`: {expected}"))
    }

    /// Whether the file (or its preset) sets `dotted`.
    pub fn is_set(&self, dotted: &str) -> bool {
        self.values.contains_key(dotted)
    }

    /// The value of `dotted` from the file, else the catalogue default; `None` when neither
    /// (a key whose absence means something the resolver works out).
    pub fn get<T: FromToml>(&self, dotted: &str) -> Option<T> {
        match self.values.get(dotted) {
            Some(v) => T::from_toml(v),
            None => {
                let (section, key) = dotted.rsplit_once('.').unwrap_or(("", dotted));
                spec(section, key)
                    .and_then(default_value)
                    .and_then(|v| T::from_toml(&v))
            }
        }
    }

    /// The value of a key whose catalogue entry has a default value.
    pub fn value<T: FromToml>(&self, dotted: &str) -> T {
        self.get(dotted).unwrap_or_else(|| {
            panic!("the key catalogue gives `{dotted}` no default of the type it is read as")
        })
    }

    /// An error about key `key` of the `i`-th function table, at its line.
    pub fn function_err(&self, i: usize, key: &str, message: &str) -> ConfigError {
        let line = self
            .lines
            .get(&format!("reward.functions.{i}.{key}"))
            .or_else(|| self.lines.get(&format!("reward.functions.{i}")))
            .copied()
            .unwrap_or_else(|| self.line("reward"));
        self.err(line, format!("key `reward.functions.{key}`: {message}"))
    }

    fn unknown(&self, dotted: &str, at: usize, candidates: Vec<&str>) -> ConfigError {
        let name = dotted.rsplit('.').next().unwrap_or(dotted);
        let hint = match closest(name, candidates.into_iter()) {
            Some(c) => format!("; did you mean `{c}`?"),
            None => String::new(),
        };
        self.err(at, format!("unknown key `{dotted}`{hint}"))
    }

    /// Checks `v` against the catalogue entry `spec` and records it under `dotted`.
    fn accept(
        &mut self,
        dotted: String,
        spec: &KeySpec,
        v: &toml::Value,
        at: usize,
    ) -> Result<(), ConfigError> {
        check(&spec.kind, v).map_err(|e| self.err(at, format!("key `{dotted}`: {e}")))?;
        self.lines.insert(dotted.clone(), at);
        self.values.insert(dotted, v.clone());
        Ok(())
    }

    fn walk(&mut self, root: &Spanned<DeTable>, values: &toml::Table) -> Result<(), ConfigError> {
        let sections = sections();
        for (key, spanned) in root.get_ref() {
            let k = key.get_ref().as_ref();
            let at = line_of(self.text, key.span().start);
            self.lines.insert(k.to_string(), at);
            let Some(value) = values.get(k) else { continue };
            match (spanned.get_ref(), value) {
                (DeValue::Table(table), toml::Value::Table(section)) if sections.contains(&k) => {
                    self.walk_section(k, table, section)?;
                }
                _ => match spec("", k) {
                    Some(flat) => {
                        self.accept(k.to_string(), flat, value, at)?;
                        if let (Kind::Preset, Some(name)) = (flat.kind, value.as_str()) {
                            self.apply_preset(name, at)?;
                        }
                    }
                    None if sections.contains(&k) => {
                        return Err(self.err(at, format!("key `{k}`: expected a [{k}] section")));
                    }
                    None => {
                        if let Some(d) = KEYS.iter().find(|d| d.key == k) {
                            return Err(self.err(
                                at,
                                format!(
                                    "unknown key `{k}`; did you mean `{}` in [{}]?",
                                    d.key, d.section
                                ),
                            ));
                        }
                        let mut valid = sections.clone();
                        valid.extend(keys_in("").map(|d| d.key));
                        return Err(self.unknown(k, at, valid));
                    }
                },
            }
        }
        Ok(())
    }

    fn walk_section(
        &mut self,
        section: &str,
        spans: &DeTable,
        values: &toml::Table,
    ) -> Result<(), ConfigError> {
        for (sub, spanned) in spans {
            let s = sub.get_ref().as_ref();
            let dotted = format!("{section}.{s}");
            let at = line_of(self.text, sub.span().start);
            self.lines.insert(dotted.clone(), at);
            // A subsection (`[model.lora]`) of this section.
            if let (DeValue::Table(table), Some(toml::Value::Table(sub_values))) =
                (spanned.get_ref(), values.get(s))
            {
                if KEYS.iter().any(|k| k.section == dotted) {
                    self.walk_section(&dotted, table, sub_values)?;
                    continue;
                }
            }
            let Some(key) = spec(section, s) else {
                return Err(self.unknown(&dotted, at, keys_in(section).map(|d| d.key).collect()));
            };
            let Some(value) = values.get(s) else { continue };
            self.accept(dotted, key, value, at)?;
            if let Kind::Tables = key.kind {
                self.walk_functions(spanned, value)?;
            }
        }
        Ok(())
    }

    /// `algorithm = "<preset>"`: the preset's keys, as if written in `[algorithm]` at its line.
    fn apply_preset(&mut self, name: &str, at: usize) -> Result<(), ConfigError> {
        let Some(p) = preset(name) else { return Ok(()) };
        for (key, text) in p.sets {
            let (Some(s), Some(v)) = (spec("algorithm", key), parse_value(text)) else {
                return Err(self.err(
                    at,
                    format!(
                        "preset {name} sets `{key}` = {text}, which is not a valid [algorithm] key"
                    ),
                ));
            };
            self.accept(format!("algorithm.{key}"), s, &v, at)?;
        }
        Ok(())
    }

    /// Checks each `[[reward.functions]]` table: known keys, a known `type`, only keys of that
    /// type, each value of its key's kind. Records their lines as `reward.functions.<i>.<key>`.
    fn walk_functions(
        &mut self,
        spans: &Spanned<DeValue>,
        values: &toml::Value,
    ) -> Result<(), ConfigError> {
        let (DeValue::Array(items), Some(tables)) = (spans.get_ref(), values.as_array()) else {
            return Ok(());
        };
        for (i, (item, table)) in items.iter().zip(tables).enumerate() {
            let (DeValue::Table(t), Some(table)) = (item.get_ref(), table.as_table()) else {
                continue;
            };
            let table_line = t
                .iter()
                .map(|(k, _)| line_of(self.text, k.span().start))
                .min()
                .unwrap_or_else(|| line_of(self.text, item.span().start));
            self.lines
                .insert(format!("reward.functions.{i}"), table_line);
            let mut keys = Vec::new();
            for (k, _) in t {
                let name = k.get_ref().as_ref();
                let at = line_of(self.text, k.span().start);
                self.lines
                    .insert(format!("reward.functions.{i}.{name}"), at);
                let Some(key) = spec("reward.functions", name) else {
                    let valid = keys_in("reward.functions").map(|d| d.key).collect();
                    return Err(self.unknown(&format!("reward.functions.{name}"), at, valid));
                };
                keys.push((key, at));
            }
            let Some(kind) = table.get("type") else {
                return Err(self.err(
                    table_line,
                    format!(
                        "[[reward.functions]] needs a `type`: one of {}",
                        reward_types().join(", ")
                    ),
                ));
            };
            let kind_line = self.line(&format!("reward.functions.{i}.type"));
            if let Some(type_spec) = spec("reward.functions", "type") {
                check(&type_spec.kind, kind).map_err(|e| {
                    self.err(kind_line, format!("key `reward.functions.type`: {e}"))
                })?;
            }
            let kind = kind.as_str().unwrap_or_default().to_string();
            let own = function_keys_of(&kind);
            for (key, at) in &keys {
                if !own.contains(&key.key) {
                    let theirs: Vec<&str> = own
                        .iter()
                        .copied()
                        .filter(|k| {
                            spec("reward.functions", k).is_some_and(|s| !s.types.is_empty())
                        })
                        .collect();
                    return Err(self.err(
                        *at,
                        format!("key `reward.functions.{}` does not apply to type \"{kind}\" (its keys: {})", key.key, theirs.join(", ")),
                    ));
                }
                if let Some(v) = table.get(key.key) {
                    check(&key.kind, v).map_err(|e| {
                        self.err(*at, format!("key `reward.functions.{}`: {e}", key.key))
                    })?;
                }
            }
            self.functions.push(FunctionTable::new(kind, table.clone()));
        }
        Ok(())
    }
}

fn given_err(path: &Path, line: usize, message: String) -> ConfigError {
    ConfigError::At {
        path: path.display().to_string(),
        line,
        message,
    }
}
