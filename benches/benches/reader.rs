//! Tensor reader throughput: one generated 3-mode tensor of about a million
//! nonzeros, written once as `.tns`, `.tns.gz` and `.ktns`, then read back
//! with `kruskal_formats::read_tensor`. Criterion reports MB/s of the file
//! on disk (compressed bytes for `.tns.gz`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use kruskal_formats::{ReadOptions, SparseTensor, read_tensor, write_tensor};

const NNZ: usize = 1 << 20;
const DIMS: [u32; 3] = [20_000, 8_000, 3_000];

/// A deterministic tensor from a 64-bit LCG (Knuth's MMIX constants), so
/// the files are the same on every machine. Values look like FROSTT's: short
/// decimals.
fn tensor() -> SparseTensor {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        state >> 33
    };
    let mut indices = vec![Vec::with_capacity(NNZ); DIMS.len()];
    let mut values = Vec::with_capacity(NNZ);
    for _ in 0..NNZ {
        for (col, &d) in indices.iter_mut().zip(&DIMS) {
            col.push((next() % u64::from(d)) as u32);
        }
        values.push((next() % 1_000_000) as f32 / 1000.0);
    }
    SparseTensor::new(DIMS.to_vec(), indices, values).expect("generated tensor is valid")
}

/// A scratch directory removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!("kruskal-reader-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn file_size(path: &Path) -> u64 {
    std::fs::metadata(path).expect("written file exists").len()
}

fn reader(c: &mut Criterion) {
    let scratch = Scratch::new();
    let t = tensor();
    let opts = ReadOptions::default();
    let mut group = c.benchmark_group("read_1M_nnz_3mode");
    // Each read takes a good fraction of a second; a few flat samples say
    // enough about throughput.
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for name in ["tensor.tns", "tensor.tns.gz", "tensor.ktns"] {
        let path = scratch.0.join(name);
        write_tensor(&path, &t).expect("write benchmark tensor");
        // The generator draws a few coordinates twice, which the tensor
        // sums: compare with its nonzeros, not with the draws.
        assert_eq!(read_tensor(&path, &opts).expect("read back").nnz(), t.nnz());
        group.throughput(Throughput::Bytes(file_size(&path)));
        group.bench_function(name, |b| {
            b.iter(|| read_tensor(&path, &opts).expect("read benchmark tensor"))
        });
    }
    group.finish();
}

criterion_group!(benches, reader);
criterion_main!(benches);
