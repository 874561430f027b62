//! Reduction kernels on raw bytes, dispatched by [`DataType`] and [`ReduceOp`].
//!
//! The executor hands the kernels byte slices: the destination and the local operand come from
//! the user's buffers (aligned for their type), the incoming operand straight from a transport
//! (a shared-memory ring or a socket buffer, possibly unaligned). Each kernel has a typed fast
//! path the compiler vectorizes and an unaligned path for the incoming side. f16 and bf16 are
//! widened to f32, combined, and rounded back by vector kernels chosen once per process for
//! the CPU (AVX-512, AVX2 + F16C, or portable code): `halves.rs` says what runs where.
//!
//! [`ReduceOp::Avg`] reduces as a sum; the executor divides once at the end with
//! [`divide_by`]. [`ReduceOp::PreMulSum`] reduces as a sum of inputs scaled before with
//! [`scale_by`].

use crate::base::dtype::{Bool, DataType};
use crate::base::op::ReduceOp;

mod copy;
mod halves;
#[cfg(target_arch = "x86_64")]
mod x86;
pub use copy::copy_streaming;
pub use halves::Path as HalfPath;

/// Arithmetic of one element type.
trait Arith: bytemuck::Pod {
    fn sum(a: Self, b: Self) -> Self;
    fn prod(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn div(a: Self, n: usize) -> Self;
    /// `a` times a premul_sum scalar (an integer value for integer types, checked before).
    fn scale(a: Self, s: f64) -> Self;
    /// Bitwise ops (on floats, of their bits: never asked for, the ops are refused before).
    fn band(a: Self, b: Self) -> Self;
    fn bor(a: Self, b: Self) -> Self;
    fn bxor(a: Self, b: Self) -> Self;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
            #[inline(always)] fn div(a: Self, n: usize) -> Self { a / (n as $t) }
            #[inline(always)] fn scale(a: Self, s: f64) -> Self { a.wrapping_mul(s as i64 as $t) }
            #[inline(always)] fn band(a: Self, b: Self) -> Self { a & b }
            #[inline(always)] fn bor(a: Self, b: Self) -> Self { a | b }
            #[inline(always)] fn bxor(a: Self, b: Self) -> Self { a ^ b }
        }
    )*};
}
int_arith!(i8, u8, u16, i32, u32, i64, u64);

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a + b }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a * b }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { a.min(b) }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { a.max(b) }
            #[inline(always)] fn div(a: Self, n: usize) -> Self { a / (n as $t) }
            #[inline(always)] fn scale(a: Self, s: f64) -> Self { a * (s as $t) }
            #[inline(always)] fn band(a: Self, b: Self) -> Self { <$t>::from_bits(a.to_bits() & b.to_bits()) }
            #[inline(always)] fn bor(a: Self, b: Self) -> Self { <$t>::from_bits(a.to_bits() | b.to_bits()) }
            #[inline(always)] fn bxor(a: Self, b: Self) -> Self { <$t>::from_bits(a.to_bits() ^ b.to_bits()) }
        }
    )*};
}
float_arith!(f32, f64);

/// Logical arithmetic, as gloo and NCCL reduce bools: sum and max are *or*, prod and min are
/// *and*. Any nonzero byte counts as true; results are 0 or 1.
impl Arith for Bool {
    #[inline(always)]
    fn sum(a: Self, b: Self) -> Self {
        Bool::bor(a, b)
    }
    #[inline(always)]
    fn prod(a: Self, b: Self) -> Self {
        Bool::band(a, b)
    }
    #[inline(always)]
    fn min(a: Self, b: Self) -> Self {
        Bool::band(a, b)
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        Bool::bor(a, b)
    }
    #[inline(always)]
    fn div(a: Self, _n: usize) -> Self {
        a // avg is refused on bool before
    }
    #[inline(always)]
    fn scale(a: Self, s: f64) -> Self {
        Bool((a.0 != 0 && s != 0.0) as u8)
    }
    #[inline(always)]
    fn band(a: Self, b: Self) -> Self {
        Bool((a.0 != 0) as u8 & (b.0 != 0) as u8)
    }
    #[inline(always)]
    fn bor(a: Self, b: Self) -> Self {
        Bool((a.0 | b.0 != 0) as u8)
    }
    #[inline(always)]
    fn bxor(a: Self, b: Self) -> Self {
        Bool((a.0 != 0) as u8 ^ (b.0 != 0) as u8)
    }
}

/// `dst[i] = f(dst[i], src[i])` with `src` possibly unaligned.
#[inline(always)]
fn combine2<T: bytemuck::Pod>(dst: &mut [T], src: &[u8], f: impl Fn(T, T) -> T) {
    let es = std::mem::size_of::<T>();
    debug_assert_eq!(std::mem::size_of_val(dst), src.len());
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(s) => {
            for (d, s) in dst.iter_mut().zip(s) {
                *d = f(*d, *s);
            }
        }
        Err(_) => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(es)) {
                *d = f(*d, bytemuck::pod_read_unaligned(s));
            }
        }
    }
}

/// `dst[i] = f(a[i], src[i])` with `src` possibly unaligned.
#[inline(always)]
fn combine3<T: bytemuck::Pod>(dst: &mut [T], a: &[T], src: &[u8], f: impl Fn(T, T) -> T) {
    let es = std::mem::size_of::<T>();
    debug_assert_eq!(std::mem::size_of_val(dst), src.len());
    debug_assert_eq!(dst.len(), a.len());
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(s) => {
            for ((d, a), s) in dst.iter_mut().zip(a).zip(s) {
                *d = f(*a, *s);
            }
        }
        Err(_) => {
            for ((d, a), s) in dst.iter_mut().zip(a).zip(src.chunks_exact(es)) {
                *d = f(*a, bytemuck::pod_read_unaligned(s));
            }
        }
    }
}

/// A binary operation, as a type so that each kernel is monomorphized (and vectorized) for it.
trait Bin<T> {
    fn f(a: T, b: T) -> T;
}

struct Sum;
struct Prod;
struct Min;
struct Max;
struct BAnd;
struct BOr;
struct BXor;

impl<T: Arith> Bin<T> for Sum {
    #[inline(always)]
    fn f(a: T, b: T) -> T {
        T::sum(a, b)
    }
}
impl<T: Arith> Bin<T> for Prod {
    #[inline(always)]
    fn f(a: T, b: T) -> T {
        T::prod(a, b)
    }
}
impl<T: Arith> Bin<T> for Min {
    #[inline(always)]
    fn f(a: T, b: T) -> T {
        T::min(a, b)
    }
}
impl<T: Arith> Bin<T> for Max {
    #[inline(always)]
    fn f(a: T, b: T) -> T {
        T::max(a, b)
    }
}
impl<T: Arith> Bin<T> for BAnd {
    #[inline(always)]
    fn f(a: T, b: T) -> T {
        T::band(a, b)
    }
}
impl<T: Arith> Bin<T> for BOr {
    #[inline(always)]
    fn f(a: T, b: T) -> T {
        T::bor(a, b)
    }
}
impl<T: Arith> Bin<T> for BXor {
    #[inline(always)]
    fn f(a: T, b: T) -> T {
        T::bxor(a, b)
    }
}

#[inline(always)]
fn kernel<T: Arith, O: Bin<T>>(dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    let a_ok = a.is_none_or(|a| bytemuck::try_cast_slice::<u8, T>(a).is_ok());
    if a_ok {
        if let Ok(d) = bytemuck::try_cast_slice_mut::<u8, T>(dst) {
            match a {
                None => combine2(d, src, O::f),
                Some(a) => combine3(d, bytemuck::cast_slice(a), src, O::f),
            }
            return;
        }
    }
    // Slow path for a misaligned destination or operand (never for the executor's buffers).
    let es = std::mem::size_of::<T>();
    for i in (0..dst.len()).step_by(es) {
        let x: T = bytemuck::pod_read_unaligned(&a.unwrap_or(dst)[i..i + es]);
        let y: T = bytemuck::pod_read_unaligned(&src[i..i + es]);
        dst[i..i + es].copy_from_slice(bytemuck::bytes_of(&O::f(x, y)));
    }
}

/// The kernel compiled for AVX2, for processors that have it (chosen at run time).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn kernel_avx2<T: Arith, O: Bin<T>>(dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    kernel::<T, O>(dst, a, src)
}

#[inline]
fn run<T: Arith, O: Bin<T>>(dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor supports AVX2 (checked just above).
        unsafe { kernel_avx2::<T, O>(dst, a, src) };
        return;
    }
    kernel::<T, O>(dst, a, src)
}

fn typed<T: Arith>(op: ReduceOp, dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => run::<T, Sum>(dst, a, src),
        ReduceOp::Prod => run::<T, Prod>(dst, a, src),
        ReduceOp::Min => run::<T, Min>(dst, a, src),
        ReduceOp::Max => run::<T, Max>(dst, a, src),
        ReduceOp::BAnd => run::<T, BAnd>(dst, a, src),
        ReduceOp::BOr => run::<T, BOr>(dst, a, src),
        ReduceOp::BXor => run::<T, BXor>(dst, a, src),
    }
}

/// `dst = dst ⊕ src` element-wise. `dst` must be aligned for `dtype`; `src` may be unaligned.
/// Both lengths must be equal multiples of the element size.
pub fn reduce_inplace(dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    dispatch(dtype, op, dst, None, src)
}

/// `dst = a ⊕ src` element-wise. `dst` and `a` must be aligned for `dtype`; `src` may be
/// unaligned. All lengths must be equal multiples of the element size.
pub fn reduce_into(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], src: &[u8]) {
    dispatch(dtype, op, dst, Some(a), src)
}

/// [`reduce_inplace`] with the f16/bf16 kernels of `path` instead of the detected ones (for
/// benchmarks and tests); `None` if this processor cannot run `path`.
pub fn reduce_inplace_on(
    path: HalfPath,
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
) -> Option<()> {
    if !path.available() {
        return None;
    }
    match (dtype, halves::op_code(op)) {
        (DataType::Bf16, Some(code)) => halves::reduce(path, halves::BF16, code, dst, None, src),
        (DataType::F16, Some(code)) => halves::reduce(path, halves::F16, code, dst, None, src),
        _ => reduce_inplace(dtype, op, dst, src),
    }
    Some(())
}

fn dispatch(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce: length mismatch");
    match dtype {
        DataType::I8 => typed::<i8>(op, dst, a, src),
        DataType::U8 => typed::<u8>(op, dst, a, src),
        DataType::I32 => typed::<i32>(op, dst, a, src),
        DataType::U32 => typed::<u32>(op, dst, a, src),
        DataType::I64 => typed::<i64>(op, dst, a, src),
        DataType::U64 => typed::<u64>(op, dst, a, src),
        DataType::F32 => typed::<f32>(op, dst, a, src),
        DataType::F64 => typed::<f64>(op, dst, a, src),
        DataType::F16 | DataType::Bf16 => match halves::op_code(op) {
            Some(code) => {
                let fmt = if dtype == DataType::Bf16 {
                    halves::BF16
                } else {
                    halves::F16
                };
                halves::reduce(halves::Path::detected(), fmt, code, dst, a, src)
            }
            // Bitwise ops are refused on floats before; of the bits, to stay defined.
            None => typed::<u16>(op, dst, a, src),
        },
        DataType::Bool => typed::<Bool>(op, dst, a, src),
        DataType::U16 => typed::<u16>(op, dst, a, src),
    }
}

/// `x = f(x)` for every element of `buf` (aligned or not).
fn map_typed<T: Arith>(buf: &mut [u8], f: impl Fn(T) -> T) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(v) => v.iter_mut().for_each(|x| *x = f(*x)),
        Err(_) => {
            for e in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                let x: T = bytemuck::pod_read_unaligned(e);
                e.copy_from_slice(bytemuck::bytes_of(&f(x)));
            }
        }
    }
}

/// Applies an element-wise operation (given for a generic type and for f32) to `buf`.
macro_rules! map_elements {
    ($dtype:expr, $buf:expr, |$x:ident: T| $typed:expr, $half_op:expr, $c:expr) => {{
        fn m<T: Arith>(buf: &mut [u8], k: impl Copy + Fn(T) -> T) {
            map_typed::<T>(buf, k)
        }
        let buf: &mut [u8] = $buf;
        match $dtype {
            DataType::I8 => m::<i8>(buf, |$x| $typed),
            DataType::U8 => m::<u8>(buf, |$x| $typed),
            DataType::U16 => m::<u16>(buf, |$x| $typed),
            DataType::I32 => m::<i32>(buf, |$x| $typed),
            DataType::U32 => m::<u32>(buf, |$x| $typed),
            DataType::I64 => m::<i64>(buf, |$x| $typed),
            DataType::U64 => m::<u64>(buf, |$x| $typed),
            DataType::F32 => m::<f32>(buf, |$x| $typed),
            DataType::F64 => m::<f64>(buf, |$x| $typed),
            DataType::Bool => m::<Bool>(buf, |$x| $typed),
            DataType::F16 => halves::map(halves::Path::detected(), halves::F16, $half_op, buf, $c),
            DataType::Bf16 => {
                halves::map(halves::Path::detected(), halves::BF16, $half_op, buf, $c)
            }
        }
    }};
}

/// Divides every element by `n` (the final step of [`ReduceOp::Avg`]); integers truncate.
pub fn divide_by(dtype: DataType, buf: &mut [u8], n: usize) {
    map_elements!(dtype, buf, |x: T| Arith::div(x, n), halves::DIV, n as f32)
}

/// Multiplies every element by `scalar` (the first step of [`ReduceOp::PreMulSum`]): floats in
/// their type (f16 and bf16 through f32), integers by `scalar as i64` wrapping, a bool stays
/// true unless `scalar` is 0.
pub fn scale_by(dtype: DataType, buf: &mut [u8], scalar: f64) {
    map_elements!(
        dtype,
        buf,
        |x: T| Arith::scale(x, scalar),
        halves::MUL,
        scalar as f32
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
    use proptest::prelude::*;

    fn from_bytes<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
        b.chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect()
    }

    fn as_bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn int_ops_wrap() {
        let mut d = as_bytes(&[250u8, 3, 7]);
        reduce_inplace(DataType::U8, ReduceOp::Sum, &mut d, &[10, 4, 1]);
        assert_eq!(d, vec![4, 7, 8]);
        let mut d = as_bytes(&[i32::MAX, -5]);
        reduce_inplace(DataType::I32, ReduceOp::Sum, &mut d, &as_bytes(&[1i32, 2]));
        assert_eq!(from_bytes::<i32>(&d), &[i32::MIN, -3]);
        let mut d = as_bytes(&[3i64, -9]);
        reduce_into(
            DataType::I64,
            ReduceOp::Max,
            &mut d,
            &as_bytes(&[5i64, -10]),
            &as_bytes(&[4i64, -11]),
        );
        assert_eq!(from_bytes::<i64>(&d), &[5, -10]);
    }

    #[test]
    fn bool_is_logical_and_bitwise_ops() {
        let (a, b) = ([0u8, 0, 1, 1, 2], [0u8, 1, 0, 1, 1]);
        let want = |op: ReduceOp| -> Vec<u8> {
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| {
                    let (x, y) = (x != 0, y != 0);
                    (match op {
                        ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => x || y,
                        ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => x && y,
                        _ => x != y,
                    }) as u8
                })
                .collect()
        };
        for op in ReduceOp::ALL.into_iter().chain(ReduceOp::BITWISE) {
            if op == ReduceOp::Avg {
                continue;
            }
            let mut d = a.to_vec();
            reduce_inplace(DataType::Bool, op, &mut d, &b);
            assert_eq!(d, want(op), "{op}");
        }
        let (x, y) = (as_bytes(&[0xF0F0u16, 7]), as_bytes(&[0x0FF0u16, 5]));
        for (op, w) in [
            (ReduceOp::BAnd, [0x00F0u16, 5]),
            (ReduceOp::BOr, [0xFFF0, 7]),
            (ReduceOp::BXor, [0xFF00, 2]),
        ] {
            let mut d = vec![0u8; 4];
            reduce_into(DataType::U16, op, &mut d, &x, &y);
            assert_eq!(from_bytes::<u16>(&d), &w, "{op}");
        }
    }

    #[test]
    fn scale_by_each_type() {
        let mut d = as_bytes(&[3i32, -4, i32::MAX]);
        scale_by(DataType::I32, &mut d, -2.0);
        assert_eq!(from_bytes::<i32>(&d), &[-6, 8, i32::MAX.wrapping_mul(-2)]);
        let mut d = as_bytes(&[f16::from_f32(3.0), f16::from_f32(-0.5)]);
        scale_by(DataType::F16, &mut d, 0.25);
        assert_eq!(
            from_bytes::<f16>(&d),
            &[f16::from_f32(0.75), f16::from_f32(-0.125)]
        );
        let mut d = vec![0u8, 1, 2];
        scale_by(DataType::Bool, &mut d, 5.0);
        assert_eq!(d, [0, 1, 1]);
        scale_by(DataType::Bool, &mut d, 0.0);
        assert_eq!(d, [0, 0, 0]);
    }

    #[test]
    fn unaligned_source() {
        let src = as_bytes(&[1.5f32, 2.0, -3.0, 4.0]);
        let mut padded = vec![0u8; src.len() + 1];
        padded[1..].copy_from_slice(&src);
        let mut d = as_bytes(&[1.0f32, 1.0, 1.0, 1.0]);
        reduce_inplace(DataType::F32, ReduceOp::Prod, &mut d, &padded[1..]);
        assert_eq!(from_bytes::<f32>(&d), &[1.5, 2.0, -3.0, 4.0]);
    }

    #[test]
    fn halves_through_f32() {
        let a: Vec<f16> = (0..1000).map(|i| f16::from_f32(i as f32)).collect();
        let b: Vec<f16> = (0..1000).map(|i| f16::from_f32(2.0 * i as f32)).collect();
        let mut d = as_bytes(&a);
        reduce_inplace(DataType::F16, ReduceOp::Sum, &mut d, &as_bytes(&b));
        let got: Vec<f16> = from_bytes::<_>(&d);
        for (i, x) in got.iter().enumerate() {
            assert_eq!(*x, f16::from_f32(3.0 * i as f32));
        }
        let mut d = as_bytes(&[bf16::from_f32(6.0), bf16::from_f32(-9.0)]);
        divide_by(DataType::Bf16, &mut d, 3);
        assert_eq!(
            from_bytes::<bf16>(&d),
            &[bf16::from_f32(2.0), bf16::from_f32(-3.0)]
        );
    }

    proptest! {
        #[test]
        fn f64_ops_match_scalar(a in proptest::collection::vec(-1e6f64..1e6, 0..300), seed in any::<u64>()) {
            let b: Vec<f64> = a.iter().enumerate().map(|(i, x)| x * 0.5 + (seed % 97) as f64 + i as f64).collect();
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                let mut d = vec![0u8; a.len() * 8];
                reduce_into(DataType::F64, op, &mut d, &as_bytes(&a), &as_bytes(&b));
                let got: Vec<f64> = from_bytes::<_>(&d);
                for i in 0..a.len() {
                    let want = match op {
                        ReduceOp::Sum => a[i] + b[i],
                        ReduceOp::Prod => a[i] * b[i],
                        ReduceOp::Min => a[i].min(b[i]),
                        _ => a[i].max(b[i]),
                    };
                    prop_assert_eq!(got[i], want);
                }
            }
        }
    }
}
