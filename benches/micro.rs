//! Micro-benchmarks: scatter / gather, gradient reduce-add, all-reduce
//! bandwidth across 2 threads next to a plain memcpy of the same size, and
//! the candle kernel that decides much of a CPU replica's backward, and the
//! fused causal attention against candle's ops at the language model's size.
//!
//! ```text
//! cargo bench --bench micro            # everything
//! cargo bench --bench micro -- all_reduce
//! RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 cargo bench --bench micro -- grad_accumulate
//! cargo bench --features mimalloc --bench micro -- attention
//! ```

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dp::comm::{ProcessGroup, ReduceOp, ThreadGroup};
use candle_dp::reduce::sum_gradients;
use candle_dp::{gather, scatter, ScatterPlan, Split};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn scatter_gather(c: &mut Criterion) {
    let mut group = c.benchmark_group("scatter_gather");
    let devices = vec![Device::Cpu; 2];
    for batch in [64usize, 1024] {
        let x = Tensor::randn(0f32, 1., (batch, 784), &Device::Cpu).unwrap();
        let plan = ScatterPlan::for_input(&x, 0, &Split::Even, &devices)
            .unwrap()
            .unwrap();
        group.bench_with_input(BenchmarkId::new("scatter_784", batch), &x, |b, x| {
            b.iter(|| scatter(x, &plan).unwrap())
        });
        let outs: Vec<Tensor> = plan
            .sizes
            .iter()
            .map(|&n| Tensor::randn(0f32, 1., (n, 10), &Device::Cpu).unwrap())
            .collect();
        group.bench_with_input(BenchmarkId::new("gather_10", batch), &outs, |b, outs| {
            b.iter(|| gather(outs.clone(), 0, &Device::Cpu).unwrap())
        });
    }
    group.finish();
}

fn reduce_add(c: &mut Criterion) {
    let mut group = c.benchmark_group("reduce_add");
    // The reference MLP's largest gradient (1024 x 1024) from 2 replicas.
    let parts: Vec<Option<Tensor>> = (0..2)
        .map(|_| Some(Tensor::randn(0f32, 1., (1024, 1024), &Device::Cpu).unwrap()))
        .collect();
    group.throughput(Throughput::Bytes(2 * 1024 * 1024 * 4));
    group.bench_function("2_replicas_1024x1024_f32", |b| {
        b.iter(|| sum_gradients(&parts, &Device::Cpu).unwrap())
    });
    group.finish();
}

/// Times `iters` all-reduces on rank 0 while rank 1 runs the same calls on
/// its own thread.
fn all_reduce(c: &mut Criterion) {
    let mut group = c.benchmark_group("all_reduce_2_threads");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(3));
    let mut ranks = ThreadGroup::new(2);
    let rank1 = ranks.pop().unwrap();
    let rank0 = ranks.pop().unwrap();
    let (work_tx, work_rx) = mpsc::channel::<(Tensor, u64)>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    // Rank 1 reduces its own tensor (other values, other storage), as real
    // ranks do.
    let partner = thread::spawn(move || {
        for (t, iters) in work_rx {
            let t = (t * 2.0).unwrap();
            for _ in 0..iters {
                rank1.all_reduce(&t, ReduceOp::Sum).unwrap();
            }
            done_tx.send(()).unwrap();
        }
    });
    for kib in [1usize, 64, 1024, 16 * 1024, 64 * 1024] {
        let elems = kib * 1024 / 4;
        let t = Tensor::ones(elems, DType::F32, &Device::Cpu).unwrap();
        group.throughput(Throughput::Bytes((kib * 1024) as u64));
        group.bench_with_input(
            BenchmarkId::new("ring_sum_f32", format!("{kib}KiB")),
            &t,
            |b, t| {
                b.iter_custom(|iters| {
                    work_tx.send((t.clone(), iters)).unwrap();
                    let start = Instant::now();
                    for _ in 0..iters {
                        rank0.all_reduce(t, ReduceOp::Sum).unwrap();
                    }
                    let elapsed = start.elapsed();
                    done_rx.recv().unwrap();
                    elapsed
                })
            },
        );
        let src = vec![1u8; kib * 1024];
        let mut dst = vec![0u8; kib * 1024];
        group.bench_function(BenchmarkId::new("memcpy", format!("{kib}KiB")), |b| {
            b.iter(|| dst.copy_from_slice(std::hint::black_box(&src)))
        });
    }
    group.finish();
    drop(work_tx);
    partner.join().unwrap();
}

/// What candle's backward does for every weight of a `Linear` layer, which
/// computes `x @ w.t()`: the gradient of `w.t()` arrives, its transpose (a
/// strided view) is added to a fresh zero tensor, which walks the gradient
/// column by column. The same add of a contiguous gradient for comparison.
/// Shapes: the benchmark MLP's two large weights. Run on one thread (see
/// above) to see one CPU replica's cost.
fn grad_accumulate(c: &mut Criterion) {
    let mut group = c.benchmark_group("grad_accumulate");
    for (rows, cols) in [(1024usize, 784usize), (1024, 1024)] {
        let grad_t = Tensor::randn(0f32, 1., (cols, rows), &Device::Cpu).unwrap();
        let grad = grad_t.t().unwrap().contiguous().unwrap();
        let shape = format!("{rows}x{cols}");
        group.throughput(Throughput::Bytes((rows * cols * 4) as u64));
        group.bench_function(BenchmarkId::new("zeros_plus_transposed", &shape), |b| {
            b.iter(|| {
                let zeros = Tensor::zeros((rows, cols), DType::F32, &Device::Cpu).unwrap();
                (zeros + grad_t.t().unwrap()).unwrap()
            })
        });
        group.bench_function(BenchmarkId::new("zeros_plus_contiguous", &shape), |b| {
            b.iter(|| {
                let zeros = Tensor::zeros((rows, cols), DType::F32, &Device::Cpu).unwrap();
                (zeros + &grad).unwrap()
            })
        });
    }
    group.finish();
}

/// One attention layer of the language model (`train_lm`'s defaults: a
/// batch of 8, 128 positions, width 128 in 4 heads), forward and backward:
/// `candle_dp::ops::causal_attention` against the same attention in
/// candle's ops (`causal_attention_unfused`: the heads split out, two
/// batched products, the mask and candle-nn's softmax between them).
fn attention(c: &mut Criterion) {
    use candle_core::Var;
    let mut group = c.benchmark_group("attention");
    let (batch, t, width, heads) = (8, 128, 128, 4);
    let qkv = Var::randn(0f32, 1., (batch, t, 3 * width), &Device::Cpu).unwrap();
    let dy = Tensor::randn(0f32, 1., (batch, t, width), &Device::Cpu).unwrap();
    let step = |f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>| {
        let y = f(qkv.as_tensor()).unwrap();
        (y * &dy).unwrap().sum_all().unwrap().backward().unwrap()
    };
    group.bench_function("fused_8x128x128_4_heads", |b| {
        b.iter(|| step(&|x| candle_dp::ops::causal_attention(x, heads)))
    });
    group.bench_function("candle_ops_8x128x128_4_heads", |b| {
        b.iter(|| step(&|x| candle_dp::ops::causal_attention_unfused(x, heads)))
    });
    group.finish();
}

criterion_group!(
    benches,
    scatter_gather,
    reduce_add,
    all_reduce,
    grad_accumulate,
    attention
);
criterion_main!(benches);
