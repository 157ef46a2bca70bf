//! What a run shows: `metrics.jsonl` (one line per step), a Prometheus `/metrics` endpoint, a
//! progress line on the terminal (plain lines when not a TTY), and the reward-curve chart.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Writes a line to stderr for the person watching, and carries on if nobody is: a closed pipe
/// (`oxrl train 2>&1 | head`) or a full disk must not stop a training run, so write errors are
/// dropped here instead of panicking as `eprintln!` does.
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Like [`note!`] without the line end (a progress line redrawn in place).
#[macro_export]
macro_rules! note_inline {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), $($arg)*);
    }};
}

/// Wall-clock seconds of each named phase of a step, reported as `time/<phase>`.
#[derive(Debug, Default)]
pub struct PhaseTimes(BTreeMap<String, f64>);

impl PhaseTimes {
    /// Runs `f` as phase `phase` (a phase run twice adds up).
    pub fn time<T>(&mut self, phase: &str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        *self.0.entry(format!("time/{phase}")).or_default() += start.elapsed().as_secs_f64();
        out
    }

    /// Seconds spent in `phase` so far.
    pub fn seconds(&self, phase: &str) -> f64 {
        self.0
            .get(&format!("time/{phase}"))
            .copied()
            .unwrap_or_default()
    }

    /// Adds another record's phases to this one's.
    pub fn absorb(&mut self, other: PhaseTimes) {
        for (phase, seconds) in other.0 {
            *self.0.entry(phase).or_default() += seconds;
        }
    }

    pub fn into_metrics(self) -> BTreeMap<String, f64> {
        self.0
    }
}

/// Appends one JSON line per step. On resume, lines past the resumed step are dropped first, so
/// the file reads as if the run had never stopped; a run that starts at step 0 (fresh, or resumed
/// before its first checkpoint) keeps none, so its step-0 validation line is written once.
pub struct MetricsLog {
    path: PathBuf,
}

impl MetricsLog {
    pub fn open(path: &Path, keep_through_step: u64) -> std::io::Result<Self> {
        if path.exists() {
            let text = std::fs::read_to_string(path)?;
            let kept: String = text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                        .is_some_and(|s| keep_through_step > 0 && s <= keep_through_step)
                })
                .map(|l| format!("{l}\n"))
                .collect();
            let tmp = path.with_extension("jsonl.tmp");
            std::fs::write(&tmp, kept)?;
            std::fs::rename(&tmp, path)?;
        }
        Ok(Self {
            path: path.to_path_buf(),
        })
    }

    pub fn append(&self, metrics: &BTreeMap<String, f64>, step: u64) -> std::io::Result<()> {
        let mut line = serde_json::Map::new();
        line.insert("step".into(), step.into());
        for (k, v) in metrics {
            line.insert(
                k.clone(),
                serde_json::Number::from_f64(*v).map_or(serde_json::Value::Null, Into::into),
            );
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        writeln!(f, "{}", serde_json::Value::Object(line))?;
        f.sync_data()
    }

    /// `(step, value)` of `key` over every logged step.
    pub fn series(&self, key: &str) -> Vec<(u64, f64)> {
        let Ok(f) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| {
                let v: serde_json::Value = serde_json::from_str(&l).ok()?;
                Some((v.get("step")?.as_u64()?, v.get(key)?.as_f64()?))
            })
            .collect()
    }
}

/// The latest step's metrics, served as Prometheus gauges. A `metrics.jsonl` key becomes a
/// metric family by [`exposition`]: per-function and per-phase keys become one family with a
/// label (`oxrl_reward{function="math"}`, `oxrl_phase_seconds{phase="rollout"}`), so names that
/// differ only in punctuation never collide, and durations carry the `_seconds` unit.
#[derive(Clone, Default)]
pub struct Gauges(Arc<Mutex<BTreeMap<String, f64>>>);

/// Where one metrics key goes in the exposition: family, label (name and value), help text.
#[derive(Debug, PartialEq)]
pub struct Exposed {
    pub family: String,
    pub label: Option<(&'static str, String)>,
    pub help: String,
}

/// Families keyed by a name after a `/`: (key prefix, family, label name, help).
const LABELLED: [(&str, &str, &str, &str); 7] = [
    (
        "time/",
        "oxrl_phase_seconds",
        "phase",
        "Wall-clock seconds of each phase of the last step",
    ),
    (
        "reward/",
        "oxrl_reward",
        "function",
        "Mean reward of each reward function in the last step",
    ),
    (
        "reward_failures/",
        "oxrl_reward_failures",
        "function",
        "Calls of each reward function that failed or timed out in the last step",
    ),
    (
        "reward_latency_s/",
        "oxrl_reward_latency_seconds",
        "function",
        "Mean seconds per call of each reward function in the last step",
    ),
    (
        "val/reward/",
        "oxrl_val_reward",
        "function",
        "Mean validation reward of each reward function",
    ),
    (
        "server_latency_s/",
        "oxrl_server_latency_seconds",
        "server",
        "Mean seconds per answered request of each rollout server in the last step",
    ),
    (
        "server_errors/",
        "oxrl_server_errors",
        "server",
        "Failed requests (retried or not) to each rollout server in the last step",
    ),
];

/// A Prometheus metric name from a metrics key: `[a-zA-Z0-9_]`, units spelled out.
fn metric_name(key: &str) -> String {
    let name: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let name = match name.strip_suffix("_per_s") {
        Some(stem) => format!("{stem}_per_second"),
        None => match name.strip_suffix("_s") {
            Some(stem) => format!("{stem}_seconds"),
            None => name,
        },
    };
    format!("oxrl_{name}")
}

/// How `key` is exposed.
pub fn exposition(key: &str) -> Exposed {
    for (prefix, family, label, help) in LABELLED {
        if let Some(name) = key.strip_prefix(prefix) {
            return Exposed {
                family: family.into(),
                label: Some((label, name.to_string())),
                help: help.into(),
            };
        }
    }
    Exposed {
        family: metric_name(key),
        label: None,
        help: format!("The last step's `{key}` (as in metrics.jsonl)"),
    }
}

/// One metric family of the exposition: its help text and its samples (labels, value).
type Family = (String, Vec<(Vec<(&'static str, String)>, f64)>);

/// A label value with `\`, `"` and newlines escaped, as the text format requires.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Gauges {
    pub fn set(&self, metrics: &BTreeMap<String, f64>) {
        if let Ok(mut g) = self.0.lock() {
            g.extend(metrics.iter().map(|(k, v)| (k.clone(), *v)));
        }
    }

    /// The Prometheus text exposition of every gauge: each family once, with `# HELP` and
    /// `# TYPE`, then its samples. Two keys that would give the same sample (`a/b` and `a_b`)
    /// are told apart by a `key` label holding each one's own name.
    pub fn render(&self) -> String {
        let g = self.0.lock().map(|g| g.clone()).unwrap_or_default();
        let mut families: BTreeMap<String, Family> = BTreeMap::new();
        let mut plain: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for key in g.keys() {
            let e = exposition(key);
            if e.label.is_none() {
                plain.entry(e.family).or_default().push(key.clone());
            }
        }
        for (key, value) in &g {
            let e = exposition(key);
            let mut labels: Vec<(&str, String)> = e.label.into_iter().collect();
            if plain.get(&e.family).is_some_and(|keys| keys.len() > 1) {
                labels.push(("key", key.clone()));
            }
            let entry = families.entry(e.family).or_insert((e.help, Vec::new()));
            entry.1.push((labels, *value));
        }
        let mut out = String::new();
        for (family, (help, samples)) in families {
            out.push_str(&format!("# HELP {family} {help}\n# TYPE {family} gauge\n"));
            for (labels, value) in samples {
                let labels: Vec<String> = labels
                    .iter()
                    .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
                    .collect();
                let labels = match labels.is_empty() {
                    true => String::new(),
                    false => format!("{{{}}}", labels.join(",")),
                };
                out.push_str(&format!("{family}{labels} {}\n", prometheus_number(value)));
            }
        }
        out
    }

    /// Serves `GET /metrics` on `host:port` from a background thread; returns the bound
    /// address. Each connection is answered on its own thread with read and write deadlines,
    /// so a client that connects and says nothing delays nobody else.
    pub fn serve(&self, host: &str, port: u16) -> std::io::Result<std::net::SocketAddr> {
        let listener = TcpListener::bind((host, port))?;
        let addr = listener.local_addr()?;
        let gauges = self.clone();
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                use std::sync::atomic::Ordering::SeqCst;
                if open.fetch_add(1, SeqCst) >= MAX_SCRAPE_CONNECTIONS {
                    open.fetch_sub(1, SeqCst);
                    continue;
                }
                let (gauges, open) = (gauges.clone(), open.clone());
                std::thread::spawn(move || {
                    answer(stream, &gauges);
                    open.fetch_sub(1, SeqCst);
                });
            }
        });
        Ok(addr)
    }
}

/// Connections answered at once; more are closed unanswered (a scraper needs one).
const MAX_SCRAPE_CONNECTIONS: usize = 16;
/// How long a connection may take to send its request line or read the answer.
const SCRAPE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

fn answer(mut stream: std::net::TcpStream, gauges: &Gauges) {
    let _ = stream.set_read_timeout(Some(SCRAPE_DEADLINE));
    let _ = stream.set_write_timeout(Some(SCRAPE_DEADLINE));
    let mut request_line = String::new();
    if BufReader::new(&stream)
        .read_line(&mut request_line)
        .is_err()
    {
        return;
    }
    let (status, body) = match request_line.split_whitespace().nth(1) {
        Some("/metrics") => ("200 OK", gauges.render()),
        _ => ("404 Not Found", "not found\n".to_string()),
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// A sample value as the text format spells it (`NaN`, `+Inf`, `-Inf` included).
fn prometheus_number(v: f64) -> String {
    match v {
        v if v.is_nan() => "NaN".into(),
        v if v == f64::INFINITY => "+Inf".into(),
        v if v == f64::NEG_INFINITY => "-Inf".into(),
        v => v.to_string(),
    }
}

/// One line per step: redrawn in place with a bar on a terminal, appended otherwise.
pub struct Progress {
    tty: bool,
    total: u64,
}

impl Progress {
    pub fn new(total: u64) -> Self {
        Self {
            tty: std::io::stderr().is_terminal(),
            total,
        }
    }

    pub fn step(&self, step: u64, m: &BTreeMap<String, f64>) {
        let shown = [
            ("reward", "reward_mean"),
            ("loss", "loss"),
            ("kl", "kl"),
            ("len", "response_length_mean"),
            ("s/step", "time/step"),
        ];
        let numbers: Vec<String> = shown
            .iter()
            .filter_map(|(label, key)| m.get(*key).map(|v| format!("{label} {v:.4}")))
            .collect();
        let numbers = numbers.join(" | ");
        if self.tty {
            let width = 24;
            let filled = (step as usize * width) / self.total.max(1) as usize;
            crate::note_inline!(
                "\r\x1b[2K[{}{}] step {step}/{} | {numbers}",
                "#".repeat(filled),
                ".".repeat(width - filled.min(width)),
                self.total
            );
            if step >= self.total {
                crate::note!();
            }
        } else {
            crate::note!("step {step}/{} | {numbers}", self.total);
        }
    }
}

/// Writes an SVG line chart of `series` (step, value) to `path`.
pub fn write_svg_chart(path: &Path, title: &str, series: &[(u64, f64)]) -> std::io::Result<()> {
    write_svg_lines(path, title, &[(String::new(), series.to_vec())])
}

/// The colours of the lines, in turn (matplotlib's first ten).
const LINE_COLOURS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// An SVG line chart of several named series over steps, on shared axes, with a legend when
/// they are named; written atomically (a temporary sibling renamed into place).
pub fn write_svg_lines(
    path: &Path,
    title: &str,
    lines: &[(String, Vec<(u64, f64)>)],
) -> std::io::Result<()> {
    let (w, h, pad) = (640.0, 360.0, 48.0);
    let all = || lines.iter().flat_map(|(_, s)| s.iter());
    let (x0, x1) = (
        all().map(|(s, _)| *s as f64).fold(f64::INFINITY, f64::min),
        all()
            .map(|(s, _)| *s as f64)
            .fold(f64::NEG_INFINITY, f64::max),
    );
    let (mut y0, mut y1) = (
        all().map(|(_, v)| *v).fold(f64::INFINITY, f64::min),
        all().map(|(_, v)| *v).fold(f64::NEG_INFINITY, f64::max),
    );
    if y1.is_nan() || y0.is_nan() || y1 <= y0 {
        y0 -= 0.5;
        y1 += 0.5;
    }
    let sx = |x: f64| pad + (x - x0) / (x1 - x0).max(1.0) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad - (y - y0) / (y1 - y0) * (h - 2.0 * pad);
    let mut body = String::new();
    for (i, (name, series)) in lines.iter().enumerate() {
        let colour = LINE_COLOURS[i % LINE_COLOURS.len()];
        let points: Vec<String> = series
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", sx(*x as f64), sy(*y)))
            .collect();
        body.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>\n",
            points.join(" ")
        ));
        if !name.is_empty() {
            let y = pad + 4.0 + 16.0 * i as f64;
            body.push_str(&format!(
                "<line x1=\"{lx0}\" y1=\"{y}\" x2=\"{lx1}\" y2=\"{y}\" stroke=\"{colour}\" stroke-width=\"2\"/><text x=\"{tx}\" y=\"{ty}\">{}</text>\n",
                xml_escape(name),
                lx0 = w - pad - 150.0,
                lx1 = w - pad - 130.0,
                tx = w - pad - 125.0,
                ty = y + 4.0,
            ));
        }
    }
    let svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{tx}" y="24" text-anchor="middle" font-size="16">{title}</text>
<line x1="{pad}" y1="{yb}" x2="{xr}" y2="{yb}" stroke="black"/>
<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{yb}" stroke="black"/>
<text x="{pad}" y="{yl}" text-anchor="middle">{x0}</text>
<text x="{xr}" y="{yl}" text-anchor="middle">{x1}</text>
<text x="{tx}" y="{yl2}" text-anchor="middle">step</text>
<text x="{lx}" y="{yb}" text-anchor="end">{y0:.2}</text>
<text x="{lx}" y="{pad}" text-anchor="end">{y1:.2}</text>
{body}</svg>
"##,
        title = xml_escape(title),
        tx = w / 2.0,
        yb = h - pad,
        xr = w - pad,
        yl = h - pad + 16.0,
        yl2 = h - 8.0,
        lx = pad - 4.0,
    );
    let tmp = path.with_extension("svg.tmp");
    std::fs::write(&tmp, svg)?;
    std::fs::rename(&tmp, path)
}

/// `text` safe inside SVG text and attributes.
fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_families_have_help_units_and_labels() {
        let g = Gauges::default();
        g.set(&BTreeMap::from([
            ("reward/math".to_string(), 0.5),
            ("loss".to_string(), -1.25),
            ("time/rollout".to_string(), 2.0),
            ("reward_latency_s/remote".to_string(), 0.125),
            ("reward_failures/code".to_string(), 3.0),
            ("rollout/tokens_per_s".to_string(), 100.0),
            ("kl".to_string(), f64::NAN),
        ]));
        let text = g.render();
        for want in [
            "# HELP oxrl_reward Mean reward of each reward function in the last step\n",
            "# TYPE oxrl_reward gauge\noxrl_reward{function=\"math\"} 0.5\n",
            "# TYPE oxrl_loss gauge\noxrl_loss -1.25\n",
            "oxrl_phase_seconds{phase=\"rollout\"} 2\n",
            "oxrl_reward_latency_seconds{function=\"remote\"} 0.125\n",
            "oxrl_reward_failures{function=\"code\"} 3\n",
            "oxrl_rollout_tokens_per_second 100\n",
            "oxrl_kl NaN\n",
        ] {
            assert!(text.contains(want), "{want:?} missing from\n{text}");
        }
        assert_eq!(
            text.matches("# HELP").count(),
            text.matches("# TYPE").count()
        );
    }

    #[test]
    fn names_that_differ_only_in_punctuation_stay_apart() {
        let g = Gauges::default();
        g.set(&BTreeMap::from([
            ("reward/a-b".to_string(), 1.0),
            ("reward/a_b".to_string(), 2.0),
            ("x/y".to_string(), 3.0),
            ("x_y".to_string(), 4.0),
            ("reward/q\"uote".to_string(), 5.0),
        ]));
        let text = g.render();
        assert!(text.contains("oxrl_reward{function=\"a-b\"} 1\n"), "{text}");
        assert!(text.contains("oxrl_reward{function=\"a_b\"} 2\n"), "{text}");
        assert!(text.contains("oxrl_x_y{key=\"x/y\"} 3\n"), "{text}");
        assert!(text.contains("oxrl_x_y{key=\"x_y\"} 4\n"), "{text}");
        assert!(
            text.contains("oxrl_reward{function=\"q\\\"uote\"} 5\n"),
            "{text}"
        );
        // Every sample line is unique.
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        let names: std::collections::BTreeSet<&str> = samples
            .iter()
            .map(|l| l.rsplit_once(' ').unwrap().0)
            .collect();
        assert_eq!(names.len(), samples.len(), "{text}");
    }

    #[test]
    fn an_idle_connection_does_not_block_a_scrape() {
        use std::io::Read;
        let g = Gauges::default();
        g.set(&BTreeMap::from([("reward_mean".to_string(), 0.75)]));
        let addr = g.serve("127.0.0.1", 0).unwrap();
        assert!(addr.ip().is_loopback());
        let _idle = std::net::TcpStream::connect(addr).unwrap();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        assert!(body.contains("oxrl_reward_mean 0.75"), "{body}");
    }

    #[test]
    fn the_endpoint_answers_real_http() {
        use std::io::Read;
        let g = Gauges::default();
        g.set(&BTreeMap::from([("reward_mean".to_string(), 0.75)]));
        let addr = g.serve("127.0.0.1", 0).unwrap();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("oxrl_reward_mean 0.75"), "{body}");
    }
}
