//! x86_64 vector kernels for bf16 and f16 (see `halves.rs` for the semantics and the dispatch).
//!
//! Each kernel handles the whole vectors of its `n` elements and returns how many it did; the
//! caller finishes the rest with the portable code. Loads and stores are unaligned.
//! bf16 widens by a shift and narrows with the integer rounding of `bf16_narrow` (the
//! AVX-512 BF16 instruction `vcvtneps2bf16` flushes subnormal results to zero, so it is not
//! used); f16 converts with `vcvtph2ps`/`vcvtps2ph` (round to nearest even), or, with
//! AVX-512 FP16, is combined natively (`reduce512fp16`).

use std::arch::asm;
use std::arch::x86_64::*;

use super::halves::{BF16, DIV, MAX, MIN, PROD, SUM};

/// One f32 operation on 16 lanes, with `min`/`max` as in `halves::apply`: `vminps(b, a)` is
/// `b < a ? b : a` and gives `a` when either is NaN; then a NaN `a` takes `b`.
macro_rules! op512 {
    ($op:expr, $x:expr, $y:expr) => {{
        let (x, y) = ($x, $y);
        match $op {
            SUM => _mm512_add_ps(x, y),
            PROD => _mm512_mul_ps(x, y),
            MIN => _mm512_mask_blend_ps(
                _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x),
                _mm512_min_ps(y, x),
                y,
            ),
            MAX => _mm512_mask_blend_ps(
                _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x),
                _mm512_max_ps(y, x),
                y,
            ),
            DIV => _mm512_div_ps(x, y),
            _ => _mm512_mul_ps(x, y),
        }
    }};
}

/// The same on 8 lanes.
macro_rules! op256 {
    ($op:expr, $x:expr, $y:expr) => {{
        let (x, y) = ($x, $y);
        match $op {
            SUM => _mm256_add_ps(x, y),
            PROD => _mm256_mul_ps(x, y),
            MIN => _mm256_blendv_ps(_mm256_min_ps(y, x), y, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x)),
            MAX => _mm256_blendv_ps(_mm256_max_ps(y, x), y, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x)),
            DIV => _mm256_div_ps(x, y),
            _ => _mm256_mul_ps(x, y),
        }
    }};
}

/// 16 elements at `p` (unaligned) as f32.
macro_rules! load512 {
    ($fmt:expr, $p:expr) => {{
        let h = _mm256_loadu_si256($p.cast::<__m256i>());
        if $fmt == BF16 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_cvtph_ps(h)
        }
    }};
}

/// Rounds 16 f32 to bf16 with the integer rounding of `bf16_narrow`: each 32-bit lane holds
/// its result in its low 16 bits (upper bits zero).
macro_rules! bf16_bits512 {
    ($v:expr) => {{
        let b = _mm512_castps_si512($v);
        let top = _mm512_srli_epi32::<16>(b);
        let bias = _mm512_add_epi32(
            _mm512_and_si512(top, _mm512_set1_epi32(1)),
            _mm512_set1_epi32(0x7fff),
        );
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
        let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
        let quiet = _mm512_or_si512(top, _mm512_set1_epi32(0x40));
        _mm512_mask_blend_epi32(nan, rounded, quiet)
    }};
}

/// 16 f32 rounded to the format and stored at `p` (unaligned).
macro_rules! store512 {
    ($fmt:expr, $p:expr, $v:expr) => {{
        let v = $v;
        let h = if $fmt == BF16 {
            _mm512_cvtepi32_epi16(bf16_bits512!(v))
        } else {
            _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)
        };
        _mm256_storeu_si256($p.cast::<__m256i>(), h);
    }};
}

/// 8 elements at `p` (unaligned) as f32.
macro_rules! load256 {
    ($fmt:expr, $p:expr) => {{
        let h = _mm_loadu_si128($p.cast::<__m128i>());
        if $fmt == BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        }
    }};
}

/// 8 f32 rounded to the format and stored at `p` (unaligned).
macro_rules! store256 {
    ($fmt:expr, $p:expr, $v:expr) => {{
        let v = $v;
        let h = if $fmt == BF16 {
            let b = _mm256_castps_si256(v);
            let top = _mm256_srli_epi32::<16>(b);
            let bias = _mm256_add_epi32(
                _mm256_and_si256(top, _mm256_set1_epi32(1)),
                _mm256_set1_epi32(0x7fff),
            );
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
            let abs = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
            // Signed compare: `abs` is below 2^31.
            let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
            let quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
            let r = _mm256_blendv_epi8(rounded, quiet, nan);
            // Every lane holds 0..=0xffff: the unsigned saturating pack keeps it.
            _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r))
        } else {
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)
        };
        _mm_storeu_si128($p.cast::<__m128i>(), h);
    }};
}

/// `d[i] = x[i] ⊕ s[i]` for the first `n / 16 * 16` elements; returns that count.
///
/// # Safety
/// The processor has AVX-512 F and BW; `x` and `s` are valid for reading and `d` for writing
/// `2n` bytes; `x` may equal `d` (each element is read before it is written), no other overlap.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn reduce512<const FMT: u8, const OP: u8>(
    d: *mut u8,
    x: *const u8,
    s: *const u8,
    n: usize,
) -> usize {
    let whole = n / 16 * 16;
    let mut i = 0;
    while i < whole {
        // SAFETY: elements i..i + 16 lie within the first n (i + 16 <= whole <= n), which the
        // caller guarantees readable at `x`, `s` and writable at `d`.
        unsafe {
            let a = load512!(FMT, x.add(2 * i));
            let b = load512!(FMT, s.add(2 * i));
            store512!(FMT, d.add(2 * i), op512!(OP, a, b));
        }
        i += 16;
    }
    whole
}

/// Word 2k of a bf16 block is word k (even element k) of the conversion, word 2k + 1 its word
/// 16 + k (odd element k).
const INTERLEAVE: [i16; 32] = {
    let mut w = [0i16; 32];
    let mut k = 0;
    while k < 32 {
        w[k] = (k / 2 + 16 * (k % 2)) as i16;
        k += 1;
    }
    w
};

/// How far ahead of the bf16 kernel its operands are prefetched, in bytes. Where they come
/// from the last-level cache or memory (the single-copy all_reduce folds 256 KiB chunks of two
/// buffers far larger than the core's caches), the kernel's ten vector instructions per 64
/// bytes leave too few of its loads in flight to hide their latency, and the fold ran at about
/// 0.75 of f32's speed per byte; see docs/algorithms.md.
const PREFETCH: usize = 8192;

/// bf16 `d[i] = x[i] ⊕ s[i]` for the first `n / 32 * 32` elements; returns that count.
///
/// Each 64-byte block is split without shuffles into its even elements (shifted up to f32)
/// and its odd ones (masked: already f32), combined, and rounded back by `vcvtne2ps2bf16`,
/// whose halves one `vpermw` interleaves. That instruction rounds as `bf16_narrow` does
/// (nearest even, a NaN kept quiet) except that it flushes subnormal inputs to zero. A sum
/// that is subnormal is exact (its top bits are taken instead, see `sum_out`); for the other
/// operations a block with a subnormal result is rounded with the integer code instead.
///
/// # Safety
/// The processor has AVX-512 F, BW, DQ and BF16; `x` and `s` are valid for reading and `d`
/// for writing `2n` bytes; `x` may equal `d` (each block is read before it is written), no
/// other overlap.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
pub(super) unsafe fn reduce512bf16<const OP: u8>(
    d: *mut u8,
    x: *const u8,
    s: *const u8,
    n: usize,
) -> usize {
    let whole = n / 32 * 32;
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let exp = _mm512_set1_epi16(0x7f80);
    // SAFETY: reads the 64 bytes of a constant array.
    let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
    // The even and odd elements of the block at element `i`, combined in f32.
    macro_rules! halves {
        ($i:expr) => {{
            // SAFETY: the callers below keep elements i..i + 32 within the first n, which
            // the caller guarantees readable at `x` and `s`.
            let (va, vb) = unsafe {
                (
                    _mm512_loadu_si512(x.add(2 * $i).cast()),
                    _mm512_loadu_si512(s.add(2 * $i).cast()),
                )
            };
            let even = op512!(
                OP,
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(va)),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(vb))
            );
            let odd = op512!(
                OP,
                _mm512_castsi512_ps(_mm512_and_si512(va, high)),
                _mm512_castsi512_ps(_mm512_and_si512(vb, high))
            );
            (even, odd)
        }};
    }
    // Both halves rounded by `vcvtne2ps2bf16` (even elements in the low 16 words).
    macro_rules! convert {
        ($even:expr, $odd:expr) => {{
            let h: __m512bh = _mm512_cvtne2ps_pbh($odd, $even);
            // SAFETY: between two 64-byte vector types (32 bf16 as 32 words).
            unsafe { std::mem::transmute::<__m512bh, __m512i>(h) }
        }};
    }
    // A block of sums from `convert` interleaved back. A subnormal f32 sum of two bf16
    // values is exact, and a multiple of the smallest bf16 subnormal: its top 16 bits are the
    // result. The converted word has a zero exponent exactly where the sum is zero or
    // subnormal (which the instruction flushes; a normal sum rounds to a normal), so those
    // words take the top bits instead.
    macro_rules! sum_out {
        ($h:expr, $even:expr, $odd:expr) => {{
            let out = _mm512_permutexvar_epi16(idx, $h);
            let tiny = _mm512_testn_epi16_mask(out, exp);
            if tiny == 0 {
                out
            } else {
                let top = _mm512_ternarylogic_epi32::<0xea>(
                    _mm512_castps_si512($odd),
                    high,
                    _mm512_srli_epi32::<16>(_mm512_castps_si512($even)),
                );
                _mm512_mask_blend_epi16(tiny, out, top)
            }
        }};
    }
    // Requests the two cache lines of each operand `PREFETCH` bytes past element `i` (while
    // they lie within the first n).
    macro_rules! prefetch {
        ($i:expr) => {{
            if 2 * $i + PREFETCH + 128 <= 2 * n {
                // SAFETY: within the first n elements (checked just above), which the caller
                // guarantees readable at `x` and `s`; a prefetch reads nothing architecturally.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(x.add(2 * $i + PREFETCH).cast());
                    _mm_prefetch::<_MM_HINT_T0>(x.add(2 * $i + PREFETCH + 64).cast());
                    _mm_prefetch::<_MM_HINT_T0>(s.add(2 * $i + PREFETCH).cast());
                    _mm_prefetch::<_MM_HINT_T0>(s.add(2 * $i + PREFETCH + 64).cast());
                }
            }
        }};
    }
    let mut i = 0;
    if OP == SUM {
        // Two blocks a step, one test of both for a zero exponent (rare) before interleaving.
        let pairs = n / 64 * 64;
        while i < pairs {
            prefetch!(i);
            let (e0, o0) = halves!(i);
            let (e1, o1) = halves!(i + 32);
            let (h0, h1) = (convert!(e0, o0), convert!(e1, o1));
            let tiny = _mm512_testn_epi16_mask(h0, exp) | _mm512_testn_epi16_mask(h1, exp);
            let (r0, r1) = if tiny == 0 {
                (
                    _mm512_permutexvar_epi16(idx, h0),
                    _mm512_permutexvar_epi16(idx, h1),
                )
            } else {
                (sum_out!(h0, e0, o0), sum_out!(h1, e1, o1))
            };
            // SAFETY: elements i..i + 64 lie within the first n (i + 64 <= pairs <= n),
            // writable at `d` (caller); both blocks were read above.
            unsafe {
                _mm512_storeu_si512(d.add(2 * i).cast(), r0);
                _mm512_storeu_si512(d.add(2 * i + 64).cast(), r1);
            }
            i += 64;
        }
    }
    while i < whole {
        if i % 64 == 0 {
            prefetch!(i);
        }
        let (even, odd) = halves!(i);
        let out = if OP == SUM {
            sum_out!(convert!(even, odd), even, odd)
        } else {
            let sub = _mm512_fpclass_ps_mask::<0x20>(even) | _mm512_fpclass_ps_mask::<0x20>(odd);
            if sub == 0 {
                _mm512_permutexvar_epi16(idx, convert!(even, odd))
            } else {
                _mm512_or_si512(
                    bf16_bits512!(even),
                    _mm512_slli_epi32::<16>(bf16_bits512!(odd)),
                )
            }
        };
        // SAFETY: elements i..i + 32 lie within the first n (i + 32 <= whole <= n), writable
        // at `d` (caller); the block was read above.
        unsafe { _mm512_storeu_si512(d.add(2 * i).cast(), out) };
        i += 32;
    }
    whole
}

/// One AVX-512 FP16 instruction `$ins z, x, y` on 32 f16 lanes (intrinsics for it are not
/// stable under the crate's MSRV, inline assembly is), with `$tail` appended (`{rn-sae}`:
/// round to nearest even whatever MXCSR says, and raise no exception).
macro_rules! ph {
    ($ins:literal, $x:expr, $y:expr $(, $tail:literal)?) => {{
        let (x, y): (__m512i, __m512i) = ($x, $y);
        let z: __m512i;
        // SAFETY: the caller runs with AVX-512 FP16 (its function's target features); the
        // instruction only reads and writes the named vector registers.
        unsafe {
            asm!(
                concat!($ins, " {z}, {x}, {y}" $(, $tail)?),
                z = lateout(zmm_reg) z,
                x = in(zmm_reg) x,
                y = in(zmm_reg) y,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
        z
    }};
}

/// `min`/`max` on 32 f16 lanes as `halves::apply` computes them (through f32, whose widening
/// quiets a NaN): `vminph(y, x)` is `y < x ? y : x` and gives `x` when either is NaN; where `x`
/// is NaN, `y` plus -0 (itself, or quieted if a NaN) is taken instead.
macro_rules! minmax_ph {
    ($ins:literal, $x:expr, $y:expr) => {{
        let (x, y): (__m512i, __m512i) = ($x, $y);
        let m = ph!($ins, y, x);
        let q = ph!("vaddph", y, _mm512_set1_epi16(0x8000_u16 as i16), ", {{rn-sae}}");
        let nan: __mmask32;
        // SAFETY: as in `ph!`: AVX-512 FP16, registers only.
        unsafe {
            asm!(
                "vcmpph {k}, {x}, {x}, 3",
                k = lateout(kreg) nan,
                x = in(zmm_reg) x,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
        _mm512_mask_blend_epi16(nan, m, q)
    }};
}

/// f16 `d[i] = x[i] ⊕ s[i]` in f16 arithmetic for the first `n / 32 * 32` elements; returns
/// that count.
///
/// This gives the bits of `halves::apply` in f32 rounded to f16. Min and max return an
/// operand (quieted if a NaN, as the f32 widening does). A product of two f16 values has at
/// most 22 significant bits and lies within f32's normal range, so the f32 product is exact
/// and rounding it once to f16 is what `vmulph` does. A sum is exact in f32 unless its
/// operands' exponents differ by more than 13; then f32 rounds it (24 bits) before f16 does
/// (11 bits), and a double rounding to nearest is innocuous when the first precision is at
/// least twice the second plus two (24 >= 2 * 11 + 2; Figueroa, "When is double rounding
/// innocuous?", 1995), so the two roundings give the correctly rounded sum, as `vaddph` does.
/// A f16 subnormal result is a normal f32, and FP16 instructions ignore MXCSR's DAZ and FTZ.
/// The exhaustive test `f16_native_equals_through_f32_every_pair` checks sum and product on
/// all 2^32 pairs.
///
/// # Safety
/// The processor has AVX-512 F, BW and FP16; `x` and `s` are valid for reading and `d` for
/// writing `2n` bytes; `x` may equal `d` (each block is read before it is written), no other
/// overlap.
#[target_feature(enable = "avx512f,avx512bw,avx512fp16")]
pub(super) unsafe fn reduce512fp16<const OP: u8>(
    d: *mut u8,
    x: *const u8,
    s: *const u8,
    n: usize,
) -> usize {
    let whole = n / 32 * 32;
    let mut i = 0;
    while i < whole {
        // SAFETY: elements i..i + 32 lie within the first n (i + 32 <= whole <= n), which the
        // caller guarantees readable at `x` and `s`.
        let (a, b) = unsafe {
            (
                _mm512_loadu_si512(x.add(2 * i).cast()),
                _mm512_loadu_si512(s.add(2 * i).cast()),
            )
        };
        let r = match OP {
            SUM => ph!("vaddph", a, b, ", {{rn-sae}}"),
            PROD => ph!("vmulph", a, b, ", {{rn-sae}}"),
            MIN => minmax_ph!("vminph", a, b),
            _ => minmax_ph!("vmaxph", a, b),
        };
        // SAFETY: as above, writable at `d`.
        unsafe { _mm512_storeu_si512(d.add(2 * i).cast(), r) };
        i += 32;
    }
    whole
}

/// `p[i] = p[i] / c` (`DIV`) or `p[i] * c` (`MUL`) for the first `n / 16 * 16` elements;
/// returns that count.
///
/// # Safety
/// The processor has AVX-512 F and BW; `p` is valid for reading and writing `2n` bytes.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn map512<const FMT: u8, const OP: u8>(p: *mut u8, n: usize, c: f32) -> usize {
    let whole = n / 16 * 16;
    let k = _mm512_set1_ps(c);
    let mut i = 0;
    while i < whole {
        // SAFETY: elements i..i + 16 lie within the first n, valid at `p` (caller).
        unsafe {
            let a = load512!(FMT, p.add(2 * i));
            store512!(FMT, p.add(2 * i), op512!(OP, a, k));
        }
        i += 16;
    }
    whole
}

/// `d[i] = x[i] ⊕ s[i]` for the first `n / 8 * 8` elements; returns that count.
///
/// # Safety
/// The processor has AVX2 and F16C; `x` and `s` are valid for reading and `d` for writing
/// `2n` bytes; `x` may equal `d` (each element is read before it is written), no other overlap.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn reduce256<const FMT: u8, const OP: u8>(
    d: *mut u8,
    x: *const u8,
    s: *const u8,
    n: usize,
) -> usize {
    let whole = n / 8 * 8;
    let mut i = 0;
    while i < whole {
        // SAFETY: elements i..i + 8 lie within the first n (i + 8 <= whole <= n), which the
        // caller guarantees readable at `x`, `s` and writable at `d`.
        unsafe {
            let a = load256!(FMT, x.add(2 * i));
            let b = load256!(FMT, s.add(2 * i));
            store256!(FMT, d.add(2 * i), op256!(OP, a, b));
        }
        i += 8;
    }
    whole
}

/// `p[i] = p[i] / c` (`DIV`) or `p[i] * c` (`MUL`) for the first `n / 8 * 8` elements;
/// returns that count.
///
/// # Safety
/// The processor has AVX2 and F16C; `p` is valid for reading and writing `2n` bytes.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn map256<const FMT: u8, const OP: u8>(p: *mut u8, n: usize, c: f32) -> usize {
    let whole = n / 8 * 8;
    let k = _mm256_set1_ps(c);
    let mut i = 0;
    while i < whole {
        // SAFETY: elements i..i + 8 lie within the first n, valid at `p` (caller).
        unsafe {
            let a = load256!(FMT, p.add(2 * i));
            store256!(FMT, p.add(2 * i), op256!(OP, a, k));
        }
        i += 8;
    }
    whole
}
