//! The bundled digits load completely; the MNIST IDX reader reads what it is given.

// Example code shared with the examples; each user needs only part of it.
use crate::example_datasets as datasets;

use datasets::{load_digits, load_mnist, shuffled_indices};

#[test]
fn bundled_digits_have_1797_samples_of_64_pixels_in_10_classes() {
    let d = load_digits(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/digits/digits.csv.gz"
    ))
    .unwrap();
    assert_eq!(d.images.dims(), &[1797, 64]);
    let mut labels = d.labels.to_vec1::<u32>().unwrap();
    labels.sort();
    labels.dedup();
    assert_eq!(labels, (0..10).collect::<Vec<_>>());
    let max = d.images.max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(
        (0.99..=1.0).contains(&max),
        "pixels scaled to [0, 1], max {max}"
    );
}

#[test]
fn mnist_idx_files_are_read_with_their_header_and_checked() {
    let dir = std::env::temp_dir().join(format!("candle_dp_mnist_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (n, h, w) = (3u32, 2u32, 2u32);
    let mut images = Vec::new();
    for v in [0x0803u32, n, h, w] {
        images.extend(v.to_be_bytes());
    }
    images.extend((0..12u8).map(|p| p * 20));
    let mut labels = Vec::new();
    for v in [0x0801u32, n] {
        labels.extend(v.to_be_bytes());
    }
    labels.extend([7u8, 1, 4]);
    std::fs::write(dir.join("t10k-images-idx3-ubyte"), &images).unwrap();
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), &labels).unwrap();
    let m = load_mnist(&dir, false).unwrap();
    assert_eq!(m.images.dims(), &[3, 4]);
    assert_eq!(m.labels.to_vec1::<u32>().unwrap(), vec![7, 1, 4]);
    assert_eq!(m.images.to_vec2::<f32>().unwrap()[2][3], 220.0 / 255.0);

    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), &labels[..9]).unwrap();
    let err = load_mnist(&dir, false).unwrap_err().to_string();
    assert!(
        err.contains("t10k-labels-idx1-ubyte") && err.contains("truncated"),
        "{err}"
    );
    let err = load_mnist(&dir, true).unwrap_err().to_string();
    assert!(err.contains("train-images-idx3-ubyte"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn shuffled_indices_are_a_seeded_permutation() {
    let a = shuffled_indices(100, 1);
    let mut sorted = a.clone();
    sorted.sort();
    assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    assert_eq!(a, shuffled_indices(100, 1));
    assert_ne!(a, shuffled_indices(100, 2));
}
