//! bf16 and f16 reductions and element maps, computed in f32 and rounded back.
//!
//! Every element's result is `round(f32(x) ⊕ f32(y))`: both operands widened exactly to f32,
//! combined there, and rounded to nearest even (bf16 by the integer rounding of
//! `half::bf16::from_f32`, with a NaN kept as a quiet NaN of its top bits; f16 as IEEE
//! conversion does it, which is what F16C's `vcvtps2ph` and `half::f16::from_f32` compute).
//! `min` and `max` are pinned to what the compiler makes of `f32::min`/`f32::max` on x86:
//! `min(a, b) = if a is NaN { b } else if b < a { b } else { a }` (and `>` for `max`), so a NaN
//! loses to a number, and of `+0`/`-0` the first operand wins.
//!
//! Which code runs is chosen once per process ([`Path::detected`]):
//!
//! | path | CPU features | per instruction | f32 ↔ bf16 | f32 ↔ f16 |
//! |---|---|---|---|---|
//! | [`Path::Avx512Fp16`] | as `Avx512Bf16`, and avx512_fp16 | 32 elements | as `Avx512Bf16` | none: `vaddph`, `vmulph`, `vminph`, `vmaxph` (maps as `Avx512`) |
//! | [`Path::Avx512Bf16`] | avx512f, avx512bw, avx512dq, avx512_bf16 | 32 elements (bf16), else as `Avx512` | mask / `vcvtne2ps2bf16` (for a subnormal result: the top bits of an exact sum, else integer rounding) | as `Avx512` |
//! | [`Path::Avx512`] | avx512f, avx512bw | 16 elements | shift / integer rounding | `vcvtph2ps` / `vcvtps2ph` |
//! | [`Path::Avx2`] | avx2, f16c | 8 elements | shift / integer rounding | `vcvtph2ps` / `vcvtps2ph` |
//! | [`Path::Portable`] | any (other targets) | what the compiler vectorizes | the same, in scalar code | `half`'s slice conversions |
//!
//! The vector paths leave the last `< 16` (or `< 8`) elements to the portable code. All paths
//! give the same bits (the tests force each one), except the payload of a NaN made from two NaN
//! operands of `sum` or `prod`, which, as in f32 arithmetic, may be either operand's.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::base::op::ReduceOp;

/// A half-precision format.
pub(super) const BF16: u8 = 0;
/// IEEE binary16.
pub(super) const F16: u8 = 1;

/// Binary operations ([`reduce`]).
pub(super) const SUM: u8 = 0;
pub(super) const PROD: u8 = 1;
pub(super) const MIN: u8 = 2;
pub(super) const MAX: u8 = 3;
/// Element maps with an f32 constant ([`map`]): `x / c` and `x * c`.
pub(super) const DIV: u8 = 4;
pub(super) const MUL: u8 = 5;

/// A set of half-precision kernels; see the module's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Scalar code, on every target.
    Portable,
    /// x86_64 with AVX2 and F16C.
    Avx2,
    /// x86_64 with AVX-512 F and BW.
    Avx512,
    /// x86_64 with AVX-512 F, BW, DQ and BF16: bf16 reductions round with `vcvtne2ps2bf16`.
    Avx512Bf16,
    /// [`Path::Avx512Bf16`] and AVX-512 FP16: f16 reductions in f16 arithmetic (the same bits
    /// as through f32; see `x86::reduce512fp16`).
    Avx512Fp16,
}

impl Path {
    /// Every path, slowest first.
    pub const ALL: [Path; 5] = [
        Path::Portable,
        Path::Avx2,
        Path::Avx512,
        Path::Avx512Bf16,
        Path::Avx512Fp16,
    ];

    /// Whether this processor can run the path.
    pub fn available(self) -> bool {
        match self {
            Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => {
                std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512Bf16 => {
                Path::Avx512.available()
                    && std::is_x86_feature_detected!("avx512dq")
                    && std::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512Fp16 => {
                Path::Avx512Bf16.available() && std::is_x86_feature_detected!("avx512fp16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Path::Avx2 | Path::Avx512 | Path::Avx512Bf16 | Path::Avx512Fp16 => false,
        }
    }

    /// The fastest path this processor runs, detected on the first call and cached.
    pub fn detected() -> Path {
        use std::sync::atomic::{AtomicU8, Ordering};
        static CACHE: AtomicU8 = AtomicU8::new(u8::MAX);
        match CACHE.load(Ordering::Relaxed) {
            0 => Path::Portable,
            1 => Path::Avx2,
            2 => Path::Avx512,
            3 => Path::Avx512Bf16,
            4 => Path::Avx512Fp16,
            _ => {
                let p = Path::ALL
                    .into_iter()
                    .rev()
                    .find(|p| p.available())
                    .unwrap_or(Path::Portable);
                CACHE.store(p as u8, Ordering::Relaxed);
                p
            }
        }
    }
}

/// The binary operation code of a (non-bitwise) reduction; `avg` and `premul_sum` reduce as
/// sums. `None` for the bitwise ops, which run on the bits elsewhere.
pub(super) fn op_code(op: ReduceOp) -> Option<u8> {
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => Some(SUM),
        ReduceOp::Prod => Some(PROD),
        ReduceOp::Min => Some(MIN),
        ReduceOp::Max => Some(MAX),
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => None,
    }
}

/// `dst = (a or dst) ⊕ src` on half-precision elements of format `fmt` with operation `op`
/// (a binary code), on `path` (which must be [`Path::available`]). Any slice may be
/// unaligned; lengths are equal (checked by the caller); a trailing odd byte is left alone.
pub(super) fn reduce(path: Path, fmt: u8, op: u8, dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    macro_rules! by_op {
        ($f:ident) => {
            match (fmt, op) {
                (BF16, SUM) => $f::<BF16, SUM>(dst, a, src),
                (BF16, PROD) => $f::<BF16, PROD>(dst, a, src),
                (BF16, MIN) => $f::<BF16, MIN>(dst, a, src),
                (BF16, MAX) => $f::<BF16, MAX>(dst, a, src),
                (_, SUM) => $f::<F16, SUM>(dst, a, src),
                (_, PROD) => $f::<F16, PROD>(dst, a, src),
                (_, MIN) => $f::<F16, MIN>(dst, a, src),
                (_, _) => $f::<F16, MAX>(dst, a, src),
            }
        };
    }
    assert_eq!(dst.len(), src.len(), "reduce: length mismatch");
    assert!(
        a.is_none_or(|a| a.len() == dst.len()),
        "reduce: length mismatch"
    );
    match path {
        Path::Portable => by_op!(portable),
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => by_op!(avx2),
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => by_op!(avx512),
        #[cfg(target_arch = "x86_64")]
        Path::Avx512Bf16 => by_op!(avx512bf16),
        #[cfg(target_arch = "x86_64")]
        Path::Avx512Fp16 => by_op!(avx512fp16),
        #[cfg(not(target_arch = "x86_64"))]
        Path::Avx2 | Path::Avx512 | Path::Avx512Bf16 | Path::Avx512Fp16 => by_op!(portable),
    }
}

/// `x = x / c` ([`DIV`]) or `x = x * c` ([`MUL`]) in f32 for every half-precision element of
/// `buf` (aligned or not), on `path` (which must be [`Path::available`]).
pub(super) fn map(path: Path, fmt: u8, op: u8, buf: &mut [u8], c: f32) {
    macro_rules! by_op {
        ($f:ident) => {
            match (fmt, op) {
                (BF16, DIV) => $f::<BF16, DIV>(buf, c),
                (BF16, _) => $f::<BF16, MUL>(buf, c),
                (_, DIV) => $f::<F16, DIV>(buf, c),
                (_, _) => $f::<F16, MUL>(buf, c),
            }
        };
    }
    match path {
        Path::Portable => by_op!(map_portable),
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => by_op!(map_avx2),
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 | Path::Avx512Bf16 | Path::Avx512Fp16 => by_op!(map_avx512),
        #[cfg(not(target_arch = "x86_64"))]
        Path::Avx2 | Path::Avx512 | Path::Avx512Bf16 | Path::Avx512Fp16 => by_op!(map_portable),
    }
}

/// The f32 arithmetic of one element (the reference every path matches).
#[inline(always)]
pub(super) fn apply<const OP: u8>(a: f32, b: f32) -> f32 {
    match OP {
        SUM => a + b,
        PROD => a * b,
        MIN => {
            if a.is_nan() || b < a {
                b
            } else {
                a
            }
        }
        MAX => {
            if a.is_nan() || b > a {
                b
            } else {
                a
            }
        }
        DIV => a / b,
        _ => a * b,
    }
}

/// bf16 bits to f32 (exact).
#[inline(always)]
pub(super) fn bf16_widen(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// f32 to bf16 bits: round to nearest even, a NaN stays a (quiet) NaN of its top bits; as
/// `half::bf16::from_f32`, branch-free.
#[inline(always)]
pub(super) fn bf16_narrow(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    if nan {
        ((b >> 16) as u16) | 0x40
    } else {
        rounded
    }
}

/// Elements per block of the portable code.
const BLOCK: usize = 256;

/// Reads the half-precision elements of `bytes` (any alignment) as f32 into `out`.
#[inline(always)]
fn widen_block<const FMT: u8>(bytes: &[u8], bits: &mut [u16], out: &mut [f32]) {
    for (h, b) in bits.iter_mut().zip(bytes.chunks_exact(2)) {
        *h = u16::from_ne_bytes([b[0], b[1]]);
    }
    if FMT == BF16 {
        for (o, h) in out.iter_mut().zip(bits.iter()) {
            *o = bf16_widen(*h);
        }
    } else {
        let h: &[f16] = bytemuck::cast_slice(bits);
        h.convert_to_f32_slice(out);
    }
}

/// Rounds `vals` to half precision and writes them to `bytes` (any alignment).
#[inline(always)]
fn narrow_block<const FMT: u8>(vals: &[f32], bits: &mut [u16], bytes: &mut [u8]) {
    if FMT == BF16 {
        for (h, v) in bits.iter_mut().zip(vals) {
            *h = bf16_narrow(*v);
        }
    } else {
        let h: &mut [f16] = bytemuck::cast_slice_mut(bits);
        h.convert_from_f32_slice(vals);
    }
    for (b, h) in bytes.chunks_exact_mut(2).zip(bits.iter()) {
        b.copy_from_slice(&h.to_ne_bytes());
    }
}

/// One element of the format at `b` (two bytes, any alignment) as f32.
#[inline(always)]
fn widen_one<const FMT: u8>(b: &[u8]) -> f32 {
    let h = u16::from_ne_bytes([b[0], b[1]]);
    if FMT == BF16 {
        bf16_widen(h)
    } else {
        f16::from_bits(h).to_f32()
    }
}

/// `v` rounded to the format, as bytes.
#[inline(always)]
fn narrow_one<const FMT: u8>(v: f32) -> [u8; 2] {
    if FMT == BF16 {
        bf16_narrow(v).to_ne_bytes()
    } else {
        f16::from_f32(v).to_bits().to_ne_bytes()
    }
}

/// Below this many elements the portable code goes element by element (no block buffers
/// to set up: the tails of the vector paths and tiny calls).
const SHORT: usize = 64;

fn portable<const FMT: u8, const OP: u8>(dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    let n = dst.len() / 2;
    if n < SHORT {
        for i in 0..n {
            let r = 2 * i..2 * i + 2;
            let x = widen_one::<FMT>(&a.unwrap_or(dst)[r.clone()]);
            let y = widen_one::<FMT>(&src[r.clone()]);
            dst[r].copy_from_slice(&narrow_one::<FMT>(apply::<OP>(x, y)));
        }
        return;
    }
    let mut x = [0f32; BLOCK];
    let mut y = [0f32; BLOCK];
    let mut bits = [0u16; BLOCK];
    let mut i = 0;
    while i < n {
        let k = (n - i).min(BLOCK);
        let r = 2 * i..2 * (i + k);
        widen_block::<FMT>(&a.unwrap_or(dst)[r.clone()], &mut bits[..k], &mut x[..k]);
        widen_block::<FMT>(&src[r.clone()], &mut bits[..k], &mut y[..k]);
        for (x, y) in x[..k].iter_mut().zip(&y[..k]) {
            *x = apply::<OP>(*x, *y);
        }
        narrow_block::<FMT>(&x[..k], &mut bits[..k], &mut dst[r]);
        i += k;
    }
}

fn map_portable<const FMT: u8, const OP: u8>(buf: &mut [u8], c: f32) {
    if buf.len() / 2 < SHORT {
        for e in buf.chunks_exact_mut(2) {
            let r = narrow_one::<FMT>(apply::<OP>(widen_one::<FMT>(e), c));
            e.copy_from_slice(&r);
        }
        return;
    }
    let mut x = [0f32; BLOCK];
    let mut bits = [0u16; BLOCK];
    for block in buf.chunks_mut(2 * BLOCK) {
        let k = block.len() / 2;
        widen_block::<FMT>(block, &mut bits[..k], &mut x[..k]);
        for x in &mut x[..k] {
            *x = apply::<OP>(*x, c);
        }
        narrow_block::<FMT>(&x[..k], &mut bits[..k], &mut block[..2 * k]);
    }
}

/// Runs an x86 kernel on the whole vectors, then the portable code on the rest.
#[cfg(target_arch = "x86_64")]
macro_rules! vector_then_rest {
    ($name:ident, $map_name:ident, $kernel:ident, $map_kernel:ident, $path:expr) => {
        fn $name<const FMT: u8, const OP: u8>(dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
            assert!($path.available());
            let n = dst.len() / 2;
            let d = dst.as_mut_ptr();
            let x = match a {
                Some(a) => a.as_ptr(),
                None => d.cast_const(),
            };
            // SAFETY: the processor has the kernel's features (asserted above). The kernel
            // reads `n` elements (2n bytes, unaligned) at `x` and at `src`, and writes 2n
            // bytes at `d`: all three slices are at least 2n bytes long (`reduce` checked
            // the lengths). `x` is either the separate slice `a` or `d` itself (read before
            // the same element is written).
            let done = unsafe { super::x86::$kernel::<FMT, OP>(d, x, src.as_ptr(), n) };
            let r = 2 * done..;
            portable::<FMT, OP>(&mut dst[r.clone()], a.map(|a| &a[r.clone()]), &src[r]);
        }

        fn $map_name<const FMT: u8, const OP: u8>(buf: &mut [u8], c: f32) {
            assert!($path.available());
            let n = buf.len() / 2;
            // SAFETY: the processor has the kernel's features (asserted above); the kernel
            // reads and writes `n` elements (2n bytes, unaligned) of `buf`, which holds them.
            let done = unsafe { super::x86::$map_kernel::<FMT, OP>(buf.as_mut_ptr(), n, c) };
            map_portable::<FMT, OP>(&mut buf[2 * done..], c);
        }
    };
}

#[cfg(target_arch = "x86_64")]
vector_then_rest!(avx512, map_avx512, reduce512, map512, Path::Avx512);

/// bf16 in blocks of 32 with `vcvtne2ps2bf16`, the rest (and f16) as [`Path::Avx512`].
#[cfg(target_arch = "x86_64")]
fn avx512bf16<const FMT: u8, const OP: u8>(dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    let mut done = 0;
    if FMT == BF16 {
        assert!(Path::Avx512Bf16.available());
        let n = dst.len() / 2;
        let d = dst.as_mut_ptr();
        let x = match a {
            Some(a) => a.as_ptr(),
            None => d.cast_const(),
        };
        // SAFETY: the processor has the kernel's features (asserted above). The kernel reads
        // `n` elements (2n bytes, unaligned) at `x` and at `src` and writes 2n bytes at `d`:
        // all three slices are at least 2n bytes long (`reduce` checked the lengths). `x` is
        // either the separate slice `a` or `d` itself (read before the same element is
        // written).
        done = unsafe { super::x86::reduce512bf16::<OP>(d, x, src.as_ptr(), n) };
    }
    let r = 2 * done..;
    avx512::<FMT, OP>(&mut dst[r.clone()], a.map(|a| &a[r.clone()]), &src[r]);
}

/// f16 in blocks of 32 in f16 arithmetic, the rest (and bf16) as [`Path::Avx512Bf16`].
#[cfg(target_arch = "x86_64")]
fn avx512fp16<const FMT: u8, const OP: u8>(dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    let mut done = 0;
    if FMT == F16 {
        assert!(Path::Avx512Fp16.available());
        let n = dst.len() / 2;
        let d = dst.as_mut_ptr();
        let x = match a {
            Some(a) => a.as_ptr(),
            None => d.cast_const(),
        };
        // SAFETY: the processor has the kernel's features (asserted above). The kernel reads
        // `n` elements (2n bytes, unaligned) at `x` and at `src` and writes 2n bytes at `d`:
        // all three slices are at least 2n bytes long (`reduce` checked the lengths). `x` is
        // either the separate slice `a` or `d` itself (read before the same element is
        // written).
        done = unsafe { super::x86::reduce512fp16::<OP>(d, x, src.as_ptr(), n) };
    }
    let r = 2 * done..;
    avx512bf16::<FMT, OP>(&mut dst[r.clone()], a.map(|a| &a[r.clone()]), &src[r]);
}

#[cfg(target_arch = "x86_64")]
vector_then_rest!(avx2, map_avx2, reduce256, map256, Path::Avx2);

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use proptest::prelude::*;

    /// The reference: one element at a time, through `half`'s own conversions.
    fn reference(fmt: u8, op: u8, x: u16, y: u16) -> u16 {
        let (a, b) = if fmt == BF16 {
            (bf16::from_bits(x).to_f32(), bf16::from_bits(y).to_f32())
        } else {
            (f16::from_bits(x).to_f32(), f16::from_bits(y).to_f32())
        };
        let r = match op {
            SUM => apply::<SUM>(a, b),
            PROD => apply::<PROD>(a, b),
            MIN => apply::<MIN>(a, b),
            MAX => apply::<MAX>(a, b),
            DIV => apply::<DIV>(a, b),
            _ => apply::<MUL>(a, b),
        };
        if fmt == BF16 {
            bf16::from_f32(r).to_bits()
        } else {
            f16::from_f32(r).to_bits()
        }
    }

    fn is_nan(fmt: u8, x: u16) -> bool {
        if fmt == BF16 {
            bf16::from_bits(x).is_nan()
        } else {
            f16::from_bits(x).is_nan()
        }
    }

    fn bytes(v: &[u16]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    fn words(b: &[u8]) -> Vec<u16> {
        b.chunks_exact(2)
            .map(|c| u16::from_ne_bytes([c[0], c[1]]))
            .collect()
    }

    fn name(fmt: u8) -> &'static str {
        if fmt == BF16 {
            "bf16"
        } else {
            "f16"
        }
    }

    /// Checks one result against the reference: the same bits, except that a NaN made of two
    /// NaN operands may carry either's payload.
    fn check(fmt: u8, op: u8, x: u16, y: u16, got: u16, what: &str) -> Result<(), String> {
        let want = reference(fmt, op, x, y);
        let both_nan = is_nan(fmt, x) && is_nan(fmt, y) && (op == SUM || op == PROD);
        if got == want || (both_nan && is_nan(fmt, got)) {
            return Ok(());
        }
        Err(format!(
            "{what}: {} op {op}: {x:#06x} ⊕ {y:#06x} = {got:#06x}, want {want:#06x}",
            name(fmt)
        ))
    }

    /// Runs every path on `x ⊕ y` (in place, into a third buffer, at byte offsets 0 and 1)
    /// and checks each element.
    fn check_all(fmt: u8, op: u8, x: &[u16], y: &[u16]) -> Result<(), String> {
        let n = x.len();
        for path in Path::ALL {
            if !path.available() {
                eprintln!("{path:?} not available on this processor: not checked");
                continue;
            }
            for off in [0usize, 1] {
                let mut xb = vec![0u8; off];
                xb.extend(bytes(x));
                let mut yb = vec![0u8; off];
                yb.extend(bytes(y));
                // In place.
                let mut d = xb.clone();
                reduce(path, fmt, op, &mut d[off..], None, &yb[off..]);
                for (i, g) in words(&d[off..]).into_iter().enumerate() {
                    check(
                        fmt,
                        op,
                        x[i],
                        y[i],
                        g,
                        &format!("{path:?} inplace off {off} n {n} i {i}"),
                    )?;
                }
                // Into a third buffer.
                let mut d = vec![0xA5u8; 2 * n + off];
                reduce(path, fmt, op, &mut d[off..], Some(&xb[off..]), &yb[off..]);
                for (i, g) in words(&d[off..]).into_iter().enumerate() {
                    check(
                        fmt,
                        op,
                        x[i],
                        y[i],
                        g,
                        &format!("{path:?} into off {off} n {n} i {i}"),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Runs every path's map of `x` by `c` and checks each element.
    fn check_map(fmt: u8, op: u8, x: &[u16], c: f32) -> Result<(), String> {
        let cbits = if fmt == BF16 {
            bf16::from_f32(c).to_bits()
        } else {
            f16::from_f32(c).to_bits()
        };
        // The reference takes a half constant: use constants exact in the format.
        let exact = if fmt == BF16 {
            bf16::from_bits(cbits).to_f32()
        } else {
            f16::from_bits(cbits).to_f32()
        };
        assert_eq!(exact.to_bits(), c.to_bits(), "test constant {c} not exact");
        for path in Path::ALL.into_iter().filter(|p| p.available()) {
            for off in [0usize, 1] {
                let mut b = vec![0u8; off];
                b.extend(bytes(x));
                map(path, fmt, op, &mut b[off..], c);
                for (i, g) in words(&b[off..]).into_iter().enumerate() {
                    let want = reference(fmt, op, x[i], cbits);
                    if g != want {
                        return Err(format!(
                            "{path:?} map {} op {op} by {c} off {off}: {:#06x} -> {g:#06x}, want {want:#06x}",
                            name(fmt),
                            x[i]
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Special values of each format: zeros, subnormals, the smallest and largest normals,
    /// infinities, quiet and signalling NaNs, and ordinary numbers, each with both signs.
    fn specials(fmt: u8) -> Vec<u16> {
        let pos: &[u16] = if fmt == BF16 {
            &[
                0x0000, 0x0001, 0x0040, 0x007f, 0x0080, 0x0081, 0x3f80, 0x3f81, 0x4000, 0x7f7f,
                0x7f80, 0x7fc0, 0x7f81, 0x7fff, 0x3c00, 0x0100,
            ]
        } else {
            &[
                0x0000, 0x0001, 0x0200, 0x03ff, 0x0400, 0x0401, 0x3c00, 0x3c01, 0x4000, 0x7bff,
                0x7c00, 0x7e00, 0x7c01, 0x7fff, 0x1400, 0x0800,
            ]
        };
        pos.iter().flat_map(|&p| [p, p | 0x8000]).collect()
    }

    const OPS: [u8; 4] = [SUM, PROD, MIN, MAX];

    #[test]
    fn portable_matches_half_conversions() {
        // The reference rounds with `half`; the portable code with `bf16_narrow` and `half`'s
        // slice conversions: every f32 pattern class agrees.
        for i in 0..200_000u32 {
            let v = f32::from_bits(i.wrapping_mul(2_654_435_761));
            let w = bf16::from_f32(v).to_bits();
            assert_eq!(bf16_narrow(v), w, "{v:e}");
            assert_eq!(
                bf16_widen(w).to_bits(),
                bf16::from_bits(w).to_f32().to_bits()
            );
        }
    }

    #[test]
    fn specials_every_pair_every_path() {
        for fmt in [BF16, F16] {
            let s = specials(fmt);
            let (x, y): (Vec<u16>, Vec<u16>) = s
                .iter()
                .flat_map(|&a| s.iter().map(move |&b| (a, b)))
                .unzip();
            for op in OPS {
                check_all(fmt, op, &x, &y).unwrap();
            }
        }
    }

    #[test]
    fn min_max_follow_x86_f32() {
        // The pinned rule is what f32::min/max compile to on x86, so also what the f32
        // kernels (which f16 went through before) compute there.
        let v = [0.0f32, -0.0, 1.0, -1.0, f32::NAN, -f32::NAN, f32::INFINITY];
        for a in v {
            for b in v {
                let (m, x) = (apply::<MIN>(a, b), apply::<MAX>(a, b));
                #[cfg(target_arch = "x86_64")]
                for (op, want) in [(ReduceOp::Min, m), (ReduceOp::Max, x)] {
                    let (xs, ys) = (vec![a; 37], vec![b; 37]);
                    let mut d = vec![0u8; 37 * 4];
                    super::super::reduce_into(
                        crate::base::dtype::DataType::F32,
                        op,
                        &mut d,
                        bytemuck::cast_slice(&xs),
                        bytemuck::cast_slice(&ys),
                    );
                    for g in d.chunks_exact(4) {
                        let g = f32::from_ne_bytes([g[0], g[1], g[2], g[3]]);
                        assert_eq!(g.to_bits(), want.to_bits(), "f32 {op} {a} {b}");
                    }
                }
                if a.is_nan() && b.is_nan() {
                    assert_eq!((m.to_bits(), x.to_bits()), (b.to_bits(), b.to_bits()));
                } else if a.is_nan() || b.is_nan() {
                    assert_eq!(m.to_bits(), if a.is_nan() { b } else { a }.to_bits());
                    assert_eq!(x.to_bits(), if a.is_nan() { b } else { a }.to_bits());
                } else if a == b {
                    assert_eq!((m.to_bits(), x.to_bits()), (a.to_bits(), a.to_bits()));
                } else {
                    assert_eq!((m, x), (a.min(b), a.max(b)));
                }
            }
        }
    }

    #[test]
    fn every_length() {
        for fmt in [BF16, F16] {
            // 8300: the bf16 kernel prefetches 8 KiB ahead, so only calls of more than 4160
            // elements run its prefetching steps (and stop them before the end).
            for n in [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 4099, 8300] {
                let x: Vec<u16> = (0..n as u32)
                    .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u16 & 0x7fff | 0x3000)
                    .collect();
                let y: Vec<u16> = (0..n as u32)
                    .map(|i| (i.wrapping_mul(40_503) >> 3) as u16 ^ 0xb800)
                    .collect();
                for op in OPS {
                    check_all(fmt, op, &x, &y).unwrap();
                }
                for (op, c) in [(DIV, 3.0f32), (DIV, 7.0), (MUL, 0.25), (MUL, -1.5)] {
                    check_map(fmt, op, &x, c).unwrap();
                }
            }
        }
    }

    #[test]
    fn maps_of_specials() {
        for fmt in [BF16, F16] {
            let s = specials(fmt);
            for (op, c) in [
                (DIV, 2.0f32),
                (DIV, 3.0),
                (MUL, 0.5),
                (MUL, -3.0),
                (MUL, 0.0),
            ] {
                check_map(fmt, op, &s, c).unwrap();
            }
        }
    }

    #[test]
    fn an_odd_trailing_byte_is_left_alone() {
        for path in Path::ALL.into_iter().filter(|p| p.available()) {
            for fmt in [BF16, F16] {
                let mut d = vec![0u8; 35];
                d[34] = 0x5a;
                let s = vec![0u8; 35];
                reduce(path, fmt, SUM, &mut d, None, &s);
                assert_eq!(d[34], 0x5a);
            }
        }
    }

    #[test]
    fn a_subnormal_result_in_any_block() {
        // One subnormal (or, for the product, underflowing) result at each position of
        // 101 elements: in either block of the two-block steps, the single block after them,
        // or the rest; among results that round normally.
        let n = 101;
        for fmt in [BF16, F16] {
            let (one, tiny) = if fmt == BF16 {
                (0x3f80, [0x0001, 0x0002, 0x8003, 0x0081, 0x8081])
            } else {
                (0x3c00, [0x0001, 0x0002, 0x8003, 0x0401, 0x8401])
            };
            for p in 0..n {
                for (k, &t) in tiny.iter().enumerate() {
                    let mut x = vec![one; n];
                    let mut y = vec![one | 0x0001; n];
                    x[p] = t;
                    y[p] = tiny[(k + 1) % tiny.len()] ^ 0x8000;
                    for op in OPS {
                        check_all(fmt, op, &x, &y).unwrap();
                    }
                }
            }
        }
    }

    /// Every pair of f16 values, every operation: the f16 arithmetic of
    /// [`Path::Avx512Fp16`] gives the bits of the f32 arithmetic of [`Path::Avx512`] (itself
    /// checked against the reference above), both NaN operands aside. Seconds in release,
    /// too slow unoptimized: `cargo test --release -p oxccl --lib f16_native -- --ignored`.
    #[test]
    #[ignore]
    fn f16_native_equals_through_f32_every_pair() {
        if !Path::Avx512Fp16.available() {
            eprintln!("Avx512Fp16 not available on this processor: not checked");
            return;
        }
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let yb = bytes(&all);
        let (mut got, mut want) = (vec![0u8; yb.len()], vec![0u8; yb.len()]);
        for op in OPS {
            for x in 0..=u16::MAX {
                let xb = bytes(&vec![x; all.len()]);
                reduce(Path::Avx512Fp16, F16, op, &mut got, Some(&xb), &yb);
                reduce(Path::Avx512, F16, op, &mut want, Some(&xb), &yb);
                if got == want {
                    continue;
                }
                for (y, (g, w)) in words(&got).into_iter().zip(words(&want)).enumerate() {
                    let both_nan = is_nan(F16, x) && is_nan(F16, y as u16);
                    assert!(
                        g == w || (both_nan && is_nan(F16, g)),
                        "f16 op {op}: {x:#06x} ⊕ {y:#06x}: native {g:#06x}, through f32 {w:#06x}"
                    );
                }
            }
        }
    }

    #[test]
    fn detected_is_available_and_cached() {
        let p = Path::detected();
        assert!(p.available());
        assert_eq!(Path::detected(), p);
        // The fastest one available.
        assert!(Path::ALL
            .into_iter()
            .filter(|q| q.available())
            .all(|q| q as u8 <= p as u8));
    }

    proptest! {
        #[test]
        fn random_bits_match_reference(
            xy in proptest::collection::vec(any::<(u16, u16)>(), 0..300),
            fmt in 0u8..2,
            op in 0u8..4,
        ) {
            let (x, y): (Vec<u16>, Vec<u16>) = xy.into_iter().unzip();
            if let Err(e) = check_all(fmt, op, &x, &y) {
                prop_assert!(false, "{}", e);
            }
        }

        #[test]
        fn random_numbers_match_reference(
            v in proptest::collection::vec((-1e4f32..1e4, -1e4f32..1e4), 0..300),
            fmt in 0u8..2,
            op in 0u8..4,
        ) {
            let narrow = |f: f32| if fmt == BF16 { bf16::from_f32(f).to_bits() } else { f16::from_f32(f).to_bits() };
            let (x, y): (Vec<u16>, Vec<u16>) = v.into_iter().map(|(a, b)| (narrow(a), narrow(b))).unzip();
            if let Err(e) = check_all(fmt, op, &x, &y) {
                prop_assert!(false, "{}", e);
            }
        }
    }
}
