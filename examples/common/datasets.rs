//! Small real data sets for the examples and tests: the 8x8 handwritten
//! digits bundled in `data/digits/` and MNIST from local IDX files.
//!
//! Example code, not part of candle-dp (`candle_dp_examples::datasets`),
//! so that the library does not depend on a gzip decoder.

use std::io::Read;
use std::path::Path;

use candle_core::{Device, Tensor};

/// Why a data file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A data file that cannot be read or parsed.
    #[error("{path}: {reason}")]
    Data {
        /// The file.
        path: String,
        /// What is wrong with it (with the line or offset where it applies).
        reason: String,
    },

    /// An error from candle while building the tensors.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with this module's [`DataError`].
pub type Result<T> = std::result::Result<T, DataError>;

/// Labelled images: `images` is `[n, height * width]` f32 in `[0, 1]`,
/// `labels` is `[n]` u32.
#[derive(Debug, Clone)]
pub struct LabelledImages {
    /// One flattened image per row, pixel values scaled to `[0, 1]`.
    pub images: Tensor,
    /// Class ids.
    pub labels: Tensor,
    /// Image height in pixels.
    pub height: usize,
    /// Image width in pixels.
    pub width: usize,
}

impl LabelledImages {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.dims1().unwrap_or(0)
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The samples at `indices`, in that order.
    ///
    /// # Errors
    ///
    /// [`DataError::Data`] naming the first index that is out of range.
    pub fn select(&self, indices: &[usize]) -> Result<Self> {
        let len = self.len();
        let idx: Vec<u32> = indices
            .iter()
            .enumerate()
            .map(|(position, &i)| match u32::try_from(i) {
                Ok(i32) if i < len => Ok(i32),
                _ => Err(DataError::Data {
                    path: "LabelledImages::select".into(),
                    reason: format!(
                        "index {i} (position {position}) is out of range for {len} samples"
                    ),
                }),
            })
            .collect::<Result<_>>()?;
        let idx = Tensor::from_vec(idx, indices.len(), self.images.device())?;
        Ok(Self {
            images: self.images.index_select(&idx, 0)?,
            labels: self.labels.index_select(&idx, 0)?,
            ..*self
        })
    }
}

fn data_error(path: &Path, reason: impl Into<String>) -> DataError {
    DataError::Data {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|e| data_error(path, e.to_string()))?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| data_error(path, format!("gzip: {e}")))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Loads scikit-learn's `digits.csv.gz` (1797 rows of 64 pixels 0..16 and a
/// label), e.g. the copy bundled at `data/digits/digits.csv.gz`.
pub fn load_digits(path: impl AsRef<Path>) -> Result<LabelledImages> {
    let path = path.as_ref();
    let text =
        String::from_utf8(read_maybe_gz(path)?).map_err(|e| data_error(path, e.to_string()))?;
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for (line_no, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let values = line
            .split(',')
            .map(|v| v.trim().parse::<f32>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| data_error(path, format!("line {}: {e}", line_no + 1)))?;
        if values.len() != 65 {
            return Err(data_error(
                path,
                format!(
                    "line {}: {} values, expected 64 pixels and a label",
                    line_no + 1,
                    values.len()
                ),
            ));
        }
        pixels.extend(values[..64].iter().map(|p| p / 16.0));
        let label = values[64];
        if !(label.fract() == 0.0 && (0.0..=9.0).contains(&label)) {
            return Err(data_error(
                path,
                format!(
                    "line {}: label {label} is not a digit class (an integer from 0 to 9)",
                    line_no + 1
                ),
            ));
        }
        labels.push(label as u32);
    }
    let n = labels.len();
    Ok(LabelledImages {
        images: Tensor::from_vec(pixels, (n, 64), &Device::Cpu)?,
        labels: Tensor::from_vec(labels, n, &Device::Cpu)?,
        height: 8,
        width: 8,
    })
}

/// Loads MNIST from a directory of IDX files (`train-images-idx3-ubyte`,
/// `train-labels-idx1-ubyte`, `t10k-...`), plain or with a `.gz` suffix.
/// `train` picks the training or the test files.
pub fn load_mnist(dir: impl AsRef<Path>, train: bool) -> Result<LabelledImages> {
    let prefix = if train { "train" } else { "t10k" };
    let find = |name: String| {
        let plain = dir.as_ref().join(&name);
        let gz = dir.as_ref().join(format!("{name}.gz"));
        if plain.exists() {
            plain
        } else {
            gz
        }
    };
    let images_path = find(format!("{prefix}-images-idx3-ubyte"));
    let labels_path = find(format!("{prefix}-labels-idx1-ubyte"));
    let images = read_maybe_gz(&images_path)?;
    let labels = read_maybe_gz(&labels_path)?;
    let header = |bytes: &[u8], path: &Path, magic: u32, dims: usize| -> Result<Vec<usize>> {
        let word = |i: usize| -> Result<u32> {
            bytes
                .get(4 * i..4 * i + 4)
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                .ok_or_else(|| data_error(path, "file too short for an IDX header"))
        };
        if word(0)? != magic {
            return Err(data_error(
                path,
                format!("bad IDX magic {:#x}, expected {magic:#x}", word(0)?),
            ));
        }
        (1..=dims).map(|i| word(i).map(|w| w as usize)).collect()
    };
    let img_dims = header(&images, &images_path, 0x0803, 3)?;
    let lbl_dims = header(&labels, &labels_path, 0x0801, 1)?;
    let (n, h, w) = (img_dims[0], img_dims[1], img_dims[2]);
    let image_size = h.checked_mul(w);
    let pixel_count = image_size
        .and_then(|size| size.checked_mul(n))
        .filter(|&count| count <= images.len())
        .ok_or_else(|| {
            data_error(
                &images_path,
                format!(
                    "header says {n}x{h}x{w} pixels, more than the file's {} bytes",
                    images.len()
                ),
            )
        })?;
    if lbl_dims[0] != n {
        return Err(data_error(
            &labels_path,
            format!("{} labels for {n} images", lbl_dims[0]),
        ));
    }
    let pixels = images.get(16..16 + pixel_count).ok_or_else(|| {
        data_error(
            &images_path,
            format!("truncated: expected {n}x{h}x{w} pixels"),
        )
    })?;
    let label_bytes = labels
        .get(8..8usize.saturating_add(n))
        .ok_or_else(|| data_error(&labels_path, format!("truncated: expected {n} labels")))?;
    Ok(LabelledImages {
        images: Tensor::from_vec(
            pixels.iter().map(|&p| p as f32 / 255.0).collect::<Vec<_>>(),
            (n, image_size.unwrap_or(0)),
            &Device::Cpu,
        )?,
        labels: Tensor::from_vec(
            label_bytes.iter().map(|&l| l as u32).collect::<Vec<_>>(),
            n,
            &Device::Cpu,
        )?,
        height: h,
        width: w,
    })
}

/// A deterministic permutation of `0..n` from `seed` (splitmix64 keys,
/// Fisher-Yates), for reproducible train / test splits.
pub fn shuffled_indices(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut idx: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        idx.swap(i, j);
    }
    idx
}
