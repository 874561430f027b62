//! Copies for destinations that nobody reads soon: non-temporal ("streaming") stores write
//! whole cache lines to memory without first reading them into the cache (a plain store to a
//! line that is not cached reads it first: a third memory transfer per byte copied), and
//! without evicting the data the caller works on. Worth it only for buffers larger than the
//! last-level cache; the callers decide (see [`crate::base::param::Config`]'s `nt_bytes`).

/// Copies `src` into `dst` (same length) with streaming stores where the target has them,
/// ending with a store fence so that a later release store (an event) orders after them.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        const LINE: usize = 64;
        let len = dst.len();
        let head = dst.as_ptr().align_offset(LINE).min(len);
        dst[..head].copy_from_slice(&src[..head]);
        let lines = (len - head) / LINE;
        // SAFETY: SSE2 is part of x86_64. `d` is 64-byte aligned (after `head`) and each of
        // the `lines` iterations reads 64 bytes of `src` and writes 64 bytes of `dst` inside
        // `head..head + lines * 64 <= len`; loads are unaligned. The fence completes the
        // weakly ordered streaming stores before this function returns.
        unsafe {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
            let mut d = dst.as_mut_ptr().add(head).cast::<__m128i>();
            let mut s = src.as_ptr().add(head).cast::<__m128i>();
            for _ in 0..lines {
                let a = _mm_loadu_si128(s);
                let b = _mm_loadu_si128(s.add(1));
                let c = _mm_loadu_si128(s.add(2));
                let e = _mm_loadu_si128(s.add(3));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
                d = d.add(4);
                s = s.add(4);
            }
            _mm_sfence();
        }
        let done = head + lines * LINE;
        dst[done..].copy_from_slice(&src[done..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        for off in [0, 1, 15, 63] {
            for len in [0, 1, 63, 64, 65, 200, 1000 - 64] {
                let mut dst = vec![0u8; 1000];
                copy_streaming(&mut dst[off..off + len], &src[..len]);
                assert_eq!(&dst[off..off + len], &src[..len], "off {off} len {len}");
                assert!(dst[..off].iter().all(|&x| x == 0));
                assert!(dst[off + len..].iter().all(|&x| x == 0));
            }
        }
    }
}
