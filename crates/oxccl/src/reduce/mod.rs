//! Reduction kernels on raw bytes, dispatched by [`DataType`] and [`ReduceOp`].
//!
//! The executor hands the kernels byte slices: the destination and the local operand come from
//! the user's buffers (aligned for their type), the incoming operand straight from a transport
//! (a shared-memory ring or a socket buffer, possibly unaligned). Each kernel has a typed fast
//! path the compiler vectorizes and an unaligned path for the incoming side. f16 and bf16 are
//! widened to f32 in small blocks, combined, and rounded back.
//!
//! [`ReduceOp::Avg`] reduces as a sum; the executor divides once at the end with
//! [`divide_by`].

use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::dtype::DataType;
use crate::op::ReduceOp;

/// Arithmetic of one element type.
trait Arith: bytemuck::Pod {
    fn sum(a: Self, b: Self) -> Self;
    fn prod(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn div(a: Self, n: usize) -> Self;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
            #[inline(always)] fn div(a: Self, n: usize) -> Self { a / (n as $t) }
        }
    )*};
}
int_arith!(i8, u8, i32, u32, i64, u64);

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a + b }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a * b }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { a.min(b) }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { a.max(b) }
            #[inline(always)] fn div(a: Self, n: usize) -> Self { a / (n as $t) }
        }
    )*};
}
float_arith!(f32, f64);

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

fn pick<T: Arith>(op: ReduceOp) -> fn(T, T) -> T {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => T::sum,
        ReduceOp::Prod => T::prod,
        ReduceOp::Min => T::min,
        ReduceOp::Max => T::max,
    }
}

fn typed<T: Arith>(op: ReduceOp, dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    let f = pick::<T>(op);
    let a_ok = a.is_none_or(|a| bytemuck::try_cast_slice::<u8, T>(a).is_ok());
    if a_ok {
        if let Ok(d) = bytemuck::try_cast_slice_mut::<u8, T>(dst) {
            match a {
                None => combine2(d, src, f),
                Some(a) => combine3(d, bytemuck::cast_slice(a), src, f),
            }
            return;
        }
    }
    // Slow path for a misaligned destination or operand (never for the executor's buffers).
    let es = std::mem::size_of::<T>();
    for i in (0..dst.len()).step_by(es) {
        let x: T = bytemuck::pod_read_unaligned(&a.unwrap_or(dst)[i..i + es]);
        let y: T = bytemuck::pod_read_unaligned(&src[i..i + es]);
        dst[i..i + es].copy_from_slice(bytemuck::bytes_of(&f(x, y)));
    }
}

/// Half-precision types, widened to f32 for the arithmetic.
trait Half: bytemuck::Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

impl Half for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

const HALF_BLOCK: usize = 256;

fn halves<H: Half>(op: ReduceOp, dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    let mut fa = [0f32; HALF_BLOCK];
    let mut fb = [0f32; HALF_BLOCK];
    let mut hb = [H::zeroed(); HALF_BLOCK];
    let bytes = HALF_BLOCK * 2;
    let mut off = 0;
    while off < dst.len() {
        let len = (dst.len() - off).min(bytes);
        let n = len / 2;
        // Any side may be unaligned: go through aligned blocks.
        let left = a.unwrap_or(dst);
        bytemuck::cast_slice_mut::<H, u8>(&mut hb[..n]).copy_from_slice(&left[off..off + len]);
        H::widen(&hb[..n], &mut fa[..n]);
        bytemuck::cast_slice_mut::<H, u8>(&mut hb[..n]).copy_from_slice(&src[off..off + len]);
        H::widen(&hb[..n], &mut fb[..n]);
        combine2(
            &mut fa[..n],
            bytemuck::cast_slice(&fb[..n]),
            pick::<f32>(op),
        );
        H::narrow(&fa[..n], &mut hb[..n]);
        dst[off..off + len].copy_from_slice(bytemuck::cast_slice(&hb[..n]));
        off += len;
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
        DataType::F16 => halves::<f16>(op, dst, a, src),
        DataType::Bf16 => halves::<bf16>(op, dst, a, src),
    }
}

fn div_typed<T: Arith>(buf: &mut [u8], n: usize) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(v) => v.iter_mut().for_each(|x| *x = T::div(*x, n)),
        Err(_) => {
            for e in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                let x: T = bytemuck::pod_read_unaligned(e);
                e.copy_from_slice(bytemuck::bytes_of(&T::div(x, n)));
            }
        }
    }
}

fn div_half<H: Half>(buf: &mut [u8], n: usize) {
    let mut f = [0f32; HALF_BLOCK];
    let mut h = [H::zeroed(); HALF_BLOCK];
    for block in buf.chunks_mut(HALF_BLOCK * 2) {
        let k = block.len() / 2;
        bytemuck::cast_slice_mut::<H, u8>(&mut h[..k]).copy_from_slice(block);
        H::widen(&h[..k], &mut f[..k]);
        for x in &mut f[..k] {
            *x /= n as f32;
        }
        H::narrow(&f[..k], &mut h[..k]);
        block.copy_from_slice(bytemuck::cast_slice(&h[..k]));
    }
}

/// Divides every element by `n` (the final step of [`ReduceOp::Avg`]); integers truncate.
pub fn divide_by(dtype: DataType, buf: &mut [u8], n: usize) {
    match dtype {
        DataType::I8 => div_typed::<i8>(buf, n),
        DataType::U8 => div_typed::<u8>(buf, n),
        DataType::I32 => div_typed::<i32>(buf, n),
        DataType::U32 => div_typed::<u32>(buf, n),
        DataType::I64 => div_typed::<i64>(buf, n),
        DataType::U64 => div_typed::<u64>(buf, n),
        DataType::F32 => div_typed::<f32>(buf, n),
        DataType::F64 => div_typed::<f64>(buf, n),
        DataType::F16 => div_half::<f16>(buf, n),
        DataType::Bf16 => div_half::<bf16>(buf, n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
