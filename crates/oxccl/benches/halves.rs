//! f32, bf16 and f16 reductions side by side, per byte of the destination, from L1-resident to
//! memory-bound: `cargo bench -p oxccl --bench halves`. Each of sum, max and prod runs in
//! place (`dst = dst ⊕ src`) and out of place (`dst = a ⊕ src`) on 4 KiB to 64 MiB; divan
//! reports bytes per second of the destination, so equal numbers mean equal speed per byte.
//! The f16/bf16 kernels are the ones detected for this processor.
//!
//! The values are ordinary numbers (no zeros, subnormals, infinities or NaNs) that stay so
//! under repeated in-place sums, maxima and products (`prod` multiplies by ±1). Every buffer
//! starts on a 4 KiB boundary (as large tensors do), so that no load aliases the previous
//! store's address modulo 4 KiB.
//!
//! Read the `fastest` and `median` columns. `slowest` and `mean` take in samples during which
//! another process had the core: on a loaded machine (load 12 on 2 cores) one 2 MiB sample
//! preempted for a scheduler slice took 8.5 ms (0.25 GB/s) where the fastest took 0.16 ms, in
//! place and out of place alike, and a 4 KiB sample of one call took 3.3 µs (1.2 GB/s)
//! where the median took 0.1 µs. Sizes under 256 KiB repeat the call within a sample (up to
//! 256 KiB per sample), so that a sample is not one call of tens of nanoseconds timed by a
//! clock of about 20 ns precision.

use divan::counter::BytesCount;
use divan::Bencher;
use oxccl::{DataType, ReduceOp};

const SIZES: &[usize] = &[4 << 10, 32 << 10, 256 << 10, 2 << 20, 64 << 20];

fn main() {
    divan::main();
}

/// A 4 KiB-aligned unit of buffer.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

// SAFETY: plain bytes, no padding (4096 bytes aligned to 4096), every bit pattern valid.
unsafe impl bytemuck::Zeroable for Page {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for Page {}

/// `bytes` of `dtype` values: for `unit`, ±1; else magnitudes in [0.5, 2) with random signs.
fn values(dtype: DataType, bytes: usize, seed: u32, unit: bool) -> Vec<Page> {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    };
    let mut out = vec![Page([0; 4096]); bytes / 4096];
    let b: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
    let mut f = || {
        let r = next();
        let sign = if r & 1 == 0 { 1.0f32 } else { -1.0 };
        let m = if unit {
            1.0
        } else {
            0.5 + 1.5 * (r >> 8) as f32 / (1u32 << 24) as f32
        };
        sign * m
    };
    match dtype {
        DataType::F32 => b
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&f().to_ne_bytes())),
        DataType::Bf16 => b
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&((f().to_bits() >> 16) as u16).to_ne_bytes())),
        _ => b.chunks_exact_mut(2).for_each(|c| {
            // f32 -> f16 bits for these magnitudes (normal, exponent -1..0), truncated.
            let x = f();
            let bits = x.to_bits();
            let sign = ((bits >> 16) & 0x8000) as u16;
            let exp = (((bits >> 23) & 0xff) as i32 - 127 + 15) as u16;
            let man = ((bits >> 13) & 0x3ff) as u16;
            c.copy_from_slice(&(sign | exp << 10 | man).to_ne_bytes())
        }),
    }
    out
}

fn run(b: Bencher, bytes: usize, dtype: DataType, op: ReduceOp, inplace: bool) {
    let unit = op == ReduceOp::Prod;
    let a = values(dtype, bytes, 0x9e37_79b9, false);
    let src = values(dtype, bytes, 0x85eb_ca6b, unit);
    let mut dst = a.clone();
    let reps = ((256 << 10) / bytes).max(1);
    b.counter(BytesCount::new(bytes * reps)).bench_local(|| {
        for _ in 0..reps {
            let d: &mut [u8] = bytemuck::cast_slice_mut(&mut dst);
            let s: &[u8] = divan::black_box(bytemuck::cast_slice(&src));
            if inplace {
                oxccl::testing::reduce::reduce_inplace(dtype, op, d, s);
            } else {
                oxccl::testing::reduce::reduce_into(dtype, op, d, bytemuck::cast_slice(&a), s);
            }
        }
    });
}

macro_rules! benches {
    ($($name:ident: $dtype:ident $op:ident $inplace:expr;)*) => {$(
        #[divan::bench(args = SIZES, sample_count = 40)]
        fn $name(b: Bencher, bytes: usize) {
            run(b, bytes, DataType::$dtype, ReduceOp::$op, $inplace);
        }
    )*};
}

benches! {
    sum_f32_inplace: F32 Sum true;
    sum_bf16_inplace: Bf16 Sum true;
    sum_f16_inplace: F16 Sum true;
    sum_f32_into: F32 Sum false;
    sum_bf16_into: Bf16 Sum false;
    sum_f16_into: F16 Sum false;
    max_f32_inplace: F32 Max true;
    max_bf16_inplace: Bf16 Max true;
    max_f16_inplace: F16 Max true;
    max_f32_into: F32 Max false;
    max_bf16_into: Bf16 Max false;
    max_f16_into: F16 Max false;
    prod_f32_inplace: F32 Prod true;
    prod_bf16_inplace: Bf16 Prod true;
    prod_f16_inplace: F16 Prod true;
    prod_f32_into: F32 Prod false;
    prod_bf16_into: Bf16 Prod false;
    prod_f16_into: F16 Prod false;
}
