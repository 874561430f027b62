//! Reduction kernels against memcpy, on L1/L2-resident (32 KiB, 256 KiB) and memory-bound
//! (64 MiB) buffers: `cargo bench -p oxccl --bench reduce`. `*_portable`, `*_avx2`, `*_avx512` force
//! the f16/bf16 kernels of that path (skipped where the processor lacks it); the others run
//! the ones detected. A reduction reads two buffers and writes
//! one; memcpy reads one and writes one; divan reports bytes per second of the destination.

use divan::counter::BytesCount;
use divan::Bencher;
use oxccl::{DataType, ReduceOp};

const SIZES: &[usize] = &[32 << 10, 256 << 10, 64 << 20];

use oxccl::testing::reduce::HalfPath;

fn main() {
    divan::main();
}

fn buffers(bytes: usize) -> (Vec<u64>, Vec<u64>) {
    (
        vec![0x3f80_0000_3f80_0000; bytes / 8],
        vec![0x3f80_0000_3f80_0000; bytes / 8],
    )
}

#[divan::bench(args = SIZES)]
fn memcpy(b: Bencher, bytes: usize) {
    let (mut dst, src) = buffers(bytes);
    b.counter(BytesCount::new(bytes)).bench_local(|| {
        dst.copy_from_slice(divan::black_box(&src));
    });
}

/// The same copy with streaming stores (`reduce::copy_streaming`), as the single-copy
/// algorithms write results too large for the cache.
#[divan::bench(args = SIZES)]
fn memcpy_streaming(b: Bencher, bytes: usize) {
    let (mut dst, src) = buffers(bytes);
    b.counter(BytesCount::new(bytes)).bench_local(|| {
        oxccl::testing::reduce::copy_streaming(
            bytemuck::cast_slice_mut(&mut dst),
            divan::black_box(bytemuck::cast_slice(&src)),
        );
    });
}

fn reduce(b: Bencher, bytes: usize, dtype: DataType, op: ReduceOp) {
    let (mut dst, src) = buffers(bytes);
    b.counter(BytesCount::new(bytes)).bench_local(|| {
        oxccl::testing::reduce::reduce_inplace(
            dtype,
            op,
            bytemuck::cast_slice_mut(&mut dst),
            divan::black_box(bytemuck::cast_slice(&src)),
        );
    });
}

#[divan::bench(args = SIZES)]
fn sum_f32(b: Bencher, bytes: usize) {
    reduce(b, bytes, DataType::F32, ReduceOp::Sum);
}

#[divan::bench(args = SIZES)]
fn sum_f64(b: Bencher, bytes: usize) {
    reduce(b, bytes, DataType::F64, ReduceOp::Sum);
}

#[divan::bench(args = SIZES)]
fn sum_bf16(b: Bencher, bytes: usize) {
    reduce(b, bytes, DataType::Bf16, ReduceOp::Sum);
}

#[divan::bench(args = SIZES)]
fn sum_f16(b: Bencher, bytes: usize) {
    reduce(b, bytes, DataType::F16, ReduceOp::Sum);
}

#[divan::bench(args = SIZES)]
fn sum_i32(b: Bencher, bytes: usize) {
    reduce(b, bytes, DataType::I32, ReduceOp::Sum);
}

#[divan::bench(args = SIZES)]
fn max_f32(b: Bencher, bytes: usize) {
    reduce(b, bytes, DataType::F32, ReduceOp::Max);
}

#[divan::bench(args = SIZES)]
fn prod_i8(b: Bencher, bytes: usize) {
    reduce(b, bytes, DataType::I8, ReduceOp::Prod);
}

fn reduce_on(b: Bencher, bytes: usize, dtype: DataType, op: ReduceOp, path: HalfPath) {
    if !path.available() {
        return;
    }
    let (mut dst, src) = buffers(bytes);
    b.counter(BytesCount::new(bytes)).bench_local(|| {
        oxccl::testing::reduce::reduce_inplace_on(
            path,
            dtype,
            op,
            bytemuck::cast_slice_mut(&mut dst),
            divan::black_box(bytemuck::cast_slice(&src)),
        )
    });
}

#[divan::bench(args = SIZES)]
fn sum_bf16_avx512(b: Bencher, bytes: usize) {
    reduce_on(b, bytes, DataType::Bf16, ReduceOp::Sum, HalfPath::Avx512);
}

#[divan::bench(args = SIZES)]
fn sum_bf16_avx2(b: Bencher, bytes: usize) {
    reduce_on(b, bytes, DataType::Bf16, ReduceOp::Sum, HalfPath::Avx2);
}

#[divan::bench(args = SIZES)]
fn sum_bf16_portable(b: Bencher, bytes: usize) {
    reduce_on(b, bytes, DataType::Bf16, ReduceOp::Sum, HalfPath::Portable);
}

#[divan::bench(args = SIZES)]
fn sum_f16_avx2(b: Bencher, bytes: usize) {
    reduce_on(b, bytes, DataType::F16, ReduceOp::Sum, HalfPath::Avx2);
}

#[divan::bench(args = SIZES)]
fn sum_f16_portable(b: Bencher, bytes: usize) {
    reduce_on(b, bytes, DataType::F16, ReduceOp::Sum, HalfPath::Portable);
}

#[divan::bench(args = SIZES)]
fn max_bf16(b: Bencher, bytes: usize) {
    reduce(b, bytes, DataType::Bf16, ReduceOp::Max);
}

/// The final step of `avg` on bf16 (by 1, so that repeated runs keep the same values).
#[divan::bench(args = SIZES)]
fn divide_bf16(b: Bencher, bytes: usize) {
    let (mut dst, _) = buffers(bytes);
    b.counter(BytesCount::new(bytes)).bench_local(|| {
        oxccl::testing::reduce::divide_by(
            DataType::Bf16,
            divan::black_box(bytemuck::cast_slice_mut(&mut dst)),
            divan::black_box(1),
        );
    });
}
