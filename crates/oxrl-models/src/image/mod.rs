//! The Qwen3-VL image processor (transformers' `Qwen2VLImageProcessor`, PIL backend), per
//! qwen3-vl-spec §3: RGB conversion (alpha over white), `smart_resize`, PIL bicubic resize,
//! rescale and normalise, and the 2×2-merge-block patchify with the frame repeated to the
//! temporal patch.

mod resize;

pub use resize::{resize_bicubic, Image8};

use crate::error::{ModelError, Result};
use serde_json::Value;
use std::path::Path;

/// `preprocessor_config.json`, with transformers' class defaults for what it leaves out.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorConfig {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// Smallest and largest pixel count (an area) after resizing.
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
}

impl Default for ImageProcessorConfig {
    /// The values the Qwen3-VL checkpoints ship (`size` {65536, 16777216}, patch 16, mean/std 0.5).
    fn default() -> Self {
        Self {
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
        }
    }
}

impl ImageProcessorConfig {
    /// Reads `preprocessor_config.json`; both `size.{shortest,longest}_edge` and the legacy
    /// `min_pixels` / `max_pixels` (which win when both are present, as transformers maps them).
    pub fn from_file(path: &Path) -> Result<Self> {
        let v: Value = crate::config::read_json(path)?;
        Self::from_value(&v, path)
    }

    pub fn from_value(v: &Value, path: &Path) -> Result<Self> {
        let err = |key: &str, expected: &str| ModelError::ConfigKey {
            path: path.to_path_buf(),
            key: key.to_string(),
            expected: expected.to_string(),
        };
        let mut c = Self::default();
        let uint = |key: &str, at: Option<&Value>| -> Result<Option<usize>> {
            match at {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| err(key, "a positive integer")),
            }
        };
        let flag = |key: &str, default: bool| -> Result<bool> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_bool().ok_or_else(|| err(key, "true or false")),
            }
        };
        let triple = |key: &str, default: [f32; 3]| -> Result<[f32; 3]> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Number(n)) => Ok([n.as_f64().unwrap_or(0.0) as f32; 3]),
                Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                    let f = |i: usize| a[i].as_f64().unwrap_or(0.0) as f32;
                    Ok([f(0), f(1), f(2)])
                }
                Some(_) => Err(err(key, "three numbers (one per RGB channel)")),
            }
        };
        if let Some(n) = uint("patch_size", v.get("patch_size"))? {
            c.patch_size = n;
        }
        if let Some(n) = uint("temporal_patch_size", v.get("temporal_patch_size"))? {
            c.temporal_patch_size = n;
        }
        if let Some(n) = uint("merge_size", v.get("merge_size"))? {
            c.merge_size = n;
        }
        let size = v.get("size");
        if let Some(n) = uint(
            "size.shortest_edge",
            size.and_then(|s| s.get("shortest_edge")),
        )? {
            c.min_pixels = n;
        }
        if let Some(n) = uint(
            "size.longest_edge",
            size.and_then(|s| s.get("longest_edge")),
        )? {
            c.max_pixels = n;
        }
        if let Some(n) = uint("min_pixels", v.get("min_pixels"))? {
            c.min_pixels = n;
        }
        if let Some(n) = uint("max_pixels", v.get("max_pixels"))? {
            c.max_pixels = n;
        }
        c.image_mean = triple("image_mean", c.image_mean)?;
        c.image_std = triple("image_std", c.image_std)?;
        if c.image_std.contains(&0.0) {
            return Err(err("image_std", "non-zero numbers"));
        }
        if let Some(f) = v.get("rescale_factor").filter(|x| !x.is_null()) {
            c.rescale_factor = f
                .as_f64()
                .ok_or_else(|| err("rescale_factor", "a number"))?;
        }
        c.do_resize = flag("do_resize", true)?;
        c.do_rescale = flag("do_rescale", true)?;
        c.do_normalize = flag("do_normalize", true)?;
        if c.min_pixels > c.max_pixels {
            return Err(err(
                "size",
                "shortest_edge (min pixels) no larger than longest_edge (max pixels)",
            ));
        }
        Ok(c)
    }

    /// Side of the square each merged token covers (`patch_size × merge_size`).
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Values per pixel row (`C × T × P × P`, 1536 for Qwen3-VL).
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// Height and width after resizing: multiples of `factor`, with the area inside
/// `[min_pixels, max_pixels]` and the aspect ratio kept (transformers' `smart_resize`, in f64
/// with Python's round-half-to-even).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize)> {
    if height == 0 || width == 0 {
        return Err(ModelError::InvalidInput(format!(
            "image of {width}×{height} pixels has no area"
        )));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    if h.max(w) / h.min(w) > 200.0 {
        return Err(ModelError::InvalidInput(format!(
            "image of {width}×{height} pixels: the aspect ratio must be below 200"
        )));
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// One image ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedImage {
    /// `[t·h·w, C·T·P·P]` row-major f32: one row per patch, rows in 2×2-merge-block order.
    pub pixel_values: Vec<f32>,
    /// `image_grid_thw`: temporal, height and width in patches.
    pub grid_thw: [usize; 3],
}

impl ProcessedImage {
    /// Placeholder tokens the image takes in the prompt (`t·h·w / merge²`).
    pub fn num_tokens(&self, merge_size: usize) -> usize {
        self.grid_thw.iter().product::<usize>() / (merge_size * merge_size)
    }
}

/// Decodes an encoded image (PNG, JPEG, …) to 8-bit RGB; images with alpha are composited over
/// white exactly as transformers' `convert_to_rgb` does with PIL's `alpha_composite`.
pub fn decode_rgb(bytes: &[u8]) -> std::result::Result<Image8, String> {
    let img =
        image::load_from_memory(bytes).map_err(|e| format!("cannot decode the image: {e}"))?;
    let (width, height) = (img.width() as usize, img.height() as usize);
    let data = if img.color().has_alpha() {
        img.to_rgba8()
            .pixels()
            .flat_map(|p| {
                let [r, g, b, a] = p.0;
                [r, g, b].map(|c| over_white(c, a))
            })
            .collect()
    } else {
        img.to_rgb8().into_raw()
    };
    Ok(Image8 {
        width,
        height,
        channels: 3,
        data,
    })
}

/// PIL's `ImagingAlphaComposite` of one channel `c` with alpha `a` over opaque white, in its
/// 7-bit fixed point (`SHIFTFORDIV255` rounding).
fn over_white(c: u8, a: u8) -> u8 {
    const BITS: u32 = 7;
    if a == 0 {
        return 255;
    }
    let (c, a) = (u32::from(c), u32::from(a));
    let coef1 = a << BITS;
    let coef2 = (255 << BITS) - coef1;
    let tmp = c * coef1 + 255 * coef2 + (0x80 << BITS);
    ((((tmp >> 8) + tmp) >> 8) >> BITS) as u8
}

/// Turns an RGB image into the vision tower's input.
pub fn process(img: &Image8, cfg: &ImageProcessorConfig) -> Result<ProcessedImage> {
    let factor = cfg.factor();
    let (h, w) = if cfg.do_resize {
        smart_resize(
            img.height,
            img.width,
            factor,
            cfg.min_pixels,
            cfg.max_pixels,
        )?
    } else {
        (img.height, img.width)
    };
    if h % factor != 0 || w % factor != 0 {
        return Err(ModelError::InvalidInput(format!(
            "image of {}×{} pixels: without resizing, both sides must be multiples of {factor}",
            img.width, img.height
        )));
    }
    let resized = resize_bicubic(img, w, h);
    // [C, H, W] planes, rescaled in f64 then cast (numpy's `astype(float64) * scale`), normalised in f32.
    let mut planes = vec![0f32; 3 * h * w];
    for (i, px) in resized.data.chunks_exact(3).enumerate() {
        for ch in 0..3 {
            let mut v = if cfg.do_rescale {
                (f64::from(px[ch]) * cfg.rescale_factor) as f32
            } else {
                f32::from(px[ch])
            };
            if cfg.do_normalize {
                v = (v - cfg.image_mean[ch]) / cfg.image_std[ch];
            }
            planes[ch * h * w + i] = v;
        }
    }
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (gh, gw) = (h / p, w / p);
    let mut pixel_values = Vec::with_capacity(gh * gw * cfg.patch_dim());
    for br in 0..gh / m {
        for bc in 0..gw / m {
            for ir in 0..m {
                for ic in 0..m {
                    let (row, col) = (br * m + ir, bc * m + ic);
                    for ch in 0..3 {
                        let plane = &planes[ch * h * w..][..h * w];
                        for _ in 0..t {
                            for py in 0..p {
                                let start = (row * p + py) * w + col * p;
                                pixel_values.extend_from_slice(&plane[start..start + p]);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(ProcessedImage {
        pixel_values,
        grid_thw: [1, gh, gw],
    })
}

/// Where an image comes from: a file, a `data:` URL or bare base64, or bytes (a Parquet cell).
#[derive(Debug, Clone, PartialEq)]
pub enum ImageSource {
    Path(std::path::PathBuf),
    Base64(String),
    Bytes(Vec<u8>),
}

impl ImageSource {
    /// A string from a dataset or input line: a `data:` URL, else a path relative to `base`.
    pub fn from_reference(text: &str, base: &Path) -> Self {
        if text.starts_with("data:") {
            return Self::Base64(text.to_string());
        }
        let text = text.strip_prefix("file://").unwrap_or(text);
        Self::Path(base.join(text))
    }

    /// An image reference from JSON: a string (a path relative to `base`, a `data:` URL), or an
    /// object as datasets store images — `{"bytes": base64 or a byte list, "path"}`, a chat
    /// content item `{"type": "image", "image": ...}` or `{"image_url": {"url": ...}}`.
    pub fn from_json(v: &Value, base: &Path) -> std::result::Result<Self, String> {
        match v {
            Value::String(s) => Ok(Self::from_reference(s, base)),
            Value::Object(o) => {
                match o.get("bytes") {
                    Some(Value::String(b)) => return Ok(Self::Base64(b.clone())),
                    Some(Value::Array(a)) => {
                        return a
                            .iter()
                            .map(|x| x.as_u64().filter(|&b| b < 256).map(|b| b as u8))
                            .collect::<Option<Vec<u8>>>()
                            .map(Self::Bytes)
                            .ok_or_else(|| "`bytes`: expected a list of byte values".into())
                    }
                    _ => {}
                }
                for key in ["image", "path", "url"] {
                    if let Some(inner) = o.get(key).filter(|x| !x.is_null()) {
                        return Self::from_json(inner, base);
                    }
                }
                match o.get("image_url") {
                    Some(Value::String(u)) => Ok(Self::from_reference(u, base)),
                    Some(Value::Object(u)) => u
                        .get("url")
                        .and_then(Value::as_str)
                        .map(|s| Self::from_reference(s, base))
                        .ok_or_else(|| "`image_url`: expected {\"url\": ...}".into()),
                    _ => {
                        Err("an image object needs `bytes`, `path`, `image` or `image_url`".into())
                    }
                }
            }
            other => Err(format!(
                "expected an image path, data URL or object, got {other}"
            )),
        }
    }

    /// The source as a string a rollout file can hold and [`ImageSource::from_reference`] reads
    /// back wherever the file is: the absolute path, or a base64 `data:` URL for image data.
    pub fn to_reference(&self) -> String {
        use base64::Engine;
        match self {
            Self::Path(p) => std::path::absolute(p)
                .unwrap_or_else(|_| p.clone())
                .display()
                .to_string(),
            Self::Base64(s) if s.starts_with("data:") => s.clone(),
            Self::Base64(s) => format!("data:image;base64,{s}"),
            Self::Bytes(b) => format!(
                "data:image;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(b)
            ),
        }
    }

    /// What an error about this image names.
    pub fn describe(&self) -> String {
        match self {
            Self::Path(p) => p.display().to_string(),
            Self::Base64(s) => format!("a base64 image ({} characters)", s.len()),
            Self::Bytes(b) => format!("an embedded image ({} bytes)", b.len()),
        }
    }

    /// The decoded RGB image.
    pub fn load(&self) -> Result<Image8> {
        let bytes = match self {
            Self::Path(p) => std::fs::read(p).map_err(|source| ModelError::Io {
                path: p.clone(),
                source,
            })?,
            Self::Base64(s) => decode_base64(s)
                .map_err(|e| ModelError::InvalidInput(format!("{}: {e}", self.describe())))?,
            Self::Bytes(b) => b.clone(),
        };
        decode_rgb(&bytes)
            .map_err(|e| ModelError::InvalidInput(format!("{}: {e}", self.describe())))
    }
}

/// The payload of `data:image/...;base64,<payload>` or of bare base64 text.
fn decode_base64(text: &str) -> std::result::Result<Vec<u8>, String> {
    use base64::Engine;
    let payload = match text.strip_prefix("data:") {
        Some(rest) => {
            let (meta, data) = rest
                .split_once(',')
                .ok_or("a data URL needs a `,` before its payload")?;
            if !meta.ends_with(";base64") {
                return Err("only base64 data URLs are supported".into());
            }
            data
        }
        None => text,
    };
    base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|e| format!("invalid base64: {e}"))
}

/// Whether a chat content item is an image (what the chat template turns into image pads).
pub fn is_image_item(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str) == Some("image")
        || item.get("image").is_some()
        || item.get("image_url").is_some()
}

/// The images a prompt refers to, in order: `images` (a list, when given) supplies them;
/// otherwise the sources of the image items in chat `messages` contents do.
pub fn prompt_image_sources(
    images: Option<&Value>,
    messages: Option<&Value>,
    base: &Path,
) -> std::result::Result<Vec<ImageSource>, String> {
    if let Some(list) = images.filter(|v| !v.is_null()) {
        let list = list
            .as_array()
            .ok_or("`images`: expected a list of images")?;
        return list
            .iter()
            .enumerate()
            .map(|(i, v)| {
                ImageSource::from_json(v, base).map_err(|e| format!("`images[{i}]`: {e}"))
            })
            .collect();
    }
    let mut out = Vec::new();
    for message in messages.and_then(Value::as_array).into_iter().flatten() {
        for item in message
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if is_image_item(item) {
                out.push(ImageSource::from_json(item, base).map_err(|e| {
                    format!(
                        "an image item of `messages` has no source ({e}); list them in `images`"
                    )
                })?);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn image_references_in_every_form_datasets_use() {
        let base = Path::new("/data");
        let src = |v: Value| ImageSource::from_json(&v, base).unwrap();
        assert_eq!(src(json!("a.png")), ImageSource::Path("/data/a.png".into()));
        assert_eq!(
            src(json!({"bytes": [1, 2], "path": "x.png"})),
            ImageSource::Bytes(vec![1, 2])
        );
        assert_eq!(
            src(json!({"bytes": null, "path": "x.png"})),
            ImageSource::Path("/data/x.png".into())
        );
        assert_eq!(
            src(json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}})),
            ImageSource::Base64("data:image/png;base64,AA==".into())
        );
        let messages = json!([{"role": "user", "content": [
            {"type": "image", "image": "b.png"}, {"type": "text", "text": "hi"}]}]);
        let found = prompt_image_sources(None, Some(&messages), base).unwrap();
        assert_eq!(found, vec![ImageSource::Path("/data/b.png".into())]);
        let listed = prompt_image_sources(Some(&json!(["c.png"])), Some(&messages), base).unwrap();
        assert_eq!(listed, vec![ImageSource::Path("/data/c.png".into())]);
        let bare = json!([{"role": "user", "content": [{"type": "image"}]}]);
        assert!(prompt_image_sources(None, Some(&bare), base)
            .unwrap_err()
            .contains("images"));
    }

    #[test]
    fn smart_resize_matches_the_spec_examples() {
        // round(2.5) = 2 (half to even): 80×48 → 64×64 with min 4096.
        assert_eq!(smart_resize(48, 80, 32, 4096, 262_144).unwrap(), (64, 64));
        // 300×200 (w×h) under the released min 65536 → 320×224.
        assert_eq!(
            smart_resize(200, 300, 32, 65_536, 16_777_216).unwrap(),
            (224, 320)
        );
        assert_eq!(smart_resize(30, 40, 32, 4096, 262_144).unwrap(), (64, 96));
        // Over the maximum: scaled down, floor to the factor.
        assert_eq!(
            smart_resize(1000, 1000, 32, 1024, 65_536).unwrap(),
            (256, 256)
        );
        assert!(smart_resize(1, 300, 32, 4096, 262_144).is_err());
    }

    #[test]
    fn legacy_min_max_pixels_and_size_both_parse() {
        let p = Path::new("preprocessor_config.json");
        let a = ImageProcessorConfig::from_value(
            &json!({"size": {"shortest_edge": 4096, "longest_edge": 262144}}),
            p,
        )
        .unwrap();
        let b =
            ImageProcessorConfig::from_value(&json!({"min_pixels": 4096, "max_pixels": 262144}), p)
                .unwrap();
        assert_eq!(a, b);
        assert_eq!((a.min_pixels, a.max_pixels), (4096, 262_144));
        let e = ImageProcessorConfig::from_value(&json!({"image_std": [1, 0, 1]}), p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("preprocessor_config.json") && e.contains("image_std"),
            "{e}"
        );
    }

    #[test]
    fn alpha_composites_over_white() {
        assert_eq!(over_white(10, 255), 10);
        assert_eq!(over_white(10, 0), 255);
        // PIL: 0 at alpha 128 over white → 127.
        assert_eq!(over_white(0, 128), 127);
    }

    #[test]
    fn patchify_orders_rows_by_merge_block_and_repeats_the_frame() {
        // A 64×32 (w×h) image whose pixel value encodes its column block: no resize needed.
        let (w, h) = (64, 32);
        let mut data = Vec::new();
        for _y in 0..h {
            for x in 0..w {
                data.extend([(x / 16) as u8 * 50; 3]);
            }
        }
        let img = Image8 {
            width: w,
            height: h,
            channels: 3,
            data,
        };
        let cfg = ImageProcessorConfig {
            min_pixels: 1024,
            do_normalize: false,
            do_rescale: false,
            ..Default::default()
        };
        let p = process(&img, &cfg).unwrap();
        assert_eq!(p.grid_thw, [1, 2, 4]);
        let first = |row: usize| p.pixel_values[row * 1536];
        // Block (0,0) holds patches (0,0),(0,1),(1,0),(1,1): columns 0,1,0,1; then block (0,1).
        let cols: Vec<f32> = (0..8).map(first).collect();
        assert_eq!(cols, vec![0., 50., 0., 50., 100., 150., 100., 150.]);
        // Both temporal copies are equal.
        assert_eq!(p.pixel_values[..256], p.pixel_values[256..512]);
    }

    #[test]
    fn data_urls_decode_and_bad_ones_say_why() {
        let src = ImageSource::Base64("data:image/png;base64,!!".into());
        let e = src.load().unwrap_err().to_string();
        assert!(e.contains("invalid base64"), "{e}");
        let missing = ImageSource::from_reference("nope.png", Path::new("/tmp/x"));
        assert!(missing
            .load()
            .unwrap_err()
            .to_string()
            .contains("/tmp/x/nope.png"));
    }
}
