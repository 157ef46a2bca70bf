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

/// The latest step's metrics, served as Prometheus gauges (`oxrl_<name>`, `/` → `_`).
#[derive(Clone, Default)]
pub struct Gauges(Arc<Mutex<BTreeMap<String, f64>>>);

impl Gauges {
    pub fn set(&self, metrics: &BTreeMap<String, f64>) {
        if let Ok(mut g) = self.0.lock() {
            g.extend(metrics.iter().map(|(k, v)| (k.clone(), *v)));
        }
    }

    /// The Prometheus text exposition of every gauge.
    pub fn render(&self) -> String {
        let g = self.0.lock().map(|g| g.clone()).unwrap_or_default();
        let mut out = String::new();
        for (k, v) in g {
            let name: String = format!("oxrl_{k}")
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            out.push_str(&format!("# TYPE {name} gauge\n{name} {v}\n"));
        }
        out
    }

    /// Serves `GET /metrics` on `port` from a background thread; returns the bound address.
    pub fn serve(&self, port: u16) -> std::io::Result<std::net::SocketAddr> {
        let listener = TcpListener::bind(("0.0.0.0", port))?;
        let addr = listener.local_addr()?;
        let gauges = self.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut stream = stream;
                let mut request_line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut request_line);
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
        });
        Ok(addr)
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
    let (w, h, pad) = (640.0, 360.0, 48.0);
    let xs: Vec<f64> = series.iter().map(|(s, _)| *s as f64).collect();
    let ys: Vec<f64> = series.iter().map(|(_, v)| *v).collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    let (mut y0, mut y1) = (
        ys.iter().copied().fold(f64::INFINITY, f64::min),
        ys.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    if y1.is_nan() || y0.is_nan() || y1 <= y0 {
        y0 -= 0.5;
        y1 += 0.5;
    }
    let sx = |x: f64| pad + (x - x0) / (x1 - x0).max(1.0) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad - (y - y0) / (y1 - y0) * (h - 2.0 * pad);
    let points: Vec<String> = xs
        .iter()
        .zip(&ys)
        .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
        .collect();
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
<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/>
</svg>
"##,
        tx = w / 2.0,
        yb = h - pad,
        xr = w - pad,
        yl = h - pad + 16.0,
        yl2 = h - 8.0,
        lx = pad - 4.0,
        points = points.join(" "),
    );
    let tmp = path.with_extension("svg.tmp");
    std::fs::write(&tmp, svg)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_names_and_values() {
        let g = Gauges::default();
        g.set(&BTreeMap::from([
            ("reward/math".to_string(), 0.5),
            ("loss".to_string(), -1.25),
        ]));
        let text = g.render();
        assert!(
            text.contains("# TYPE oxrl_reward_math gauge\noxrl_reward_math 0.5\n"),
            "{text}"
        );
        assert!(text.contains("oxrl_loss -1.25\n"));
    }

    #[test]
    fn reward_failures_and_latency_per_function_are_gauges() {
        let g = Gauges::default();
        g.set(&BTreeMap::from([
            ("reward_failures/code".to_string(), 3.0),
            ("reward_latency_s/remote".to_string(), 0.125),
        ]));
        let text = g.render();
        assert!(text.contains("oxrl_reward_failures_code 3\n"), "{text}");
        assert!(
            text.contains("oxrl_reward_latency_s_remote 0.125\n"),
            "{text}"
        );
    }

    #[test]
    fn the_endpoint_answers_real_http() {
        use std::io::Read;
        let g = Gauges::default();
        g.set(&BTreeMap::from([("reward_mean".to_string(), 0.75)]));
        let addr = g.serve(0).unwrap();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", addr.port())).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("oxrl_reward_mean 0.75"), "{body}");
    }
}
