//! Where the single-copy reductions place their temporaries: at the page offset of the peer
//! buffer each kernel copy reads from or writes into.
//!
//! The kernel's cross-memory copies (`process_vm_readv`/`writev`) copy each page with the
//! CPU's string instructions, whose speed depends on where source and destination lie
//! relative to each other within a page. Measured on an AMD EPYC VM (kernel 6.18): a 2 MiB
//! `process_vm_writev` in 256 KiB calls takes about 0.25-0.3 ms at every `(dst - src) mod 4096`
//! except 8, 16 and 24, where it takes 1.0-1.6 ms (3.5-5x), whatever the absolute alignment
//! (`(dst - src) mod 64` alone does not decide it: 72 and 80 are fast; `scripts/cma_offsets.c`
//! measures it). A library temporary,
//! wherever the allocator put it, lands in that window for some user buffers: a torch tensor
//! starts 64 bytes into a page, and a temporary starting 48 bytes into one made every write of
//! a 4 MB all_reduce 4x slower, on one communicator and not on another of the same process.
//! A temporary that starts at the same page offset as the peer buffer (`dst - src` a multiple
//! of the page) is always in the fast case, so each temporary is a region of a chunk plus a
//! page and starts where its copy wants it.

/// The page size the offsets are taken modulo (x86-64 and most arm64 kernels).
pub(super) const PAGE: usize = 4096;

/// Relative placements closer than this (but not equal) are avoided.
const NEAR: usize = 64;

/// Whether copies between `a` and `b` have their page offsets close but not equal.
fn near(a: usize, b: usize) -> bool {
    let d = a.wrapping_sub(b) % PAGE;
    d != 0 && !(NEAR..=PAGE - NEAR).contains(&d)
}

/// The offset in `[0, PAGE)` from `region` at which a temporary shares its page offset with
/// `addr`, the peer address a kernel copy reads from or writes to.
pub(super) fn aligned_to(region: usize, addr: u64) -> usize {
    (addr as usize).wrapping_sub(region) % PAGE
}

/// The offset in `[0, PAGE)` from `region` for a temporary that kernel copies write into
/// every address of `addrs`: the page offset of the first one that is not near any other (so
/// each copy has equal or distant page offsets), else the first 64-byte step that is near
/// none, else (addresses crowded all round the page) that of the first address. 0 without
/// addresses.
pub(super) fn aligned_to_all(region: usize, addrs: &[u64]) -> usize {
    let fits = |o: usize| addrs.iter().all(|&a| !near(region + o, a as usize));
    addrs
        .iter()
        .map(|&a| aligned_to(region, a))
        .chain((0..PAGE).step_by(NEAR))
        .find(|&o| fits(o))
        .unwrap_or_else(|| addrs.first().map_or(0, |&a| aligned_to(region, a)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A temporary placed for one address shares its page offset, from any region start.
    #[test]
    fn aligned_to_matches_the_page_offset() {
        for region in [0usize, 16, 48, 4064, 4096 * 7 + 1, 123_456_789] {
            for addr in [0u64, 64, 4032, 4095, 1 << 40] {
                let o = aligned_to(region, addr);
                assert!(o < PAGE);
                assert_eq!((region + o) % PAGE, addr as usize % PAGE, "{region} {addr}");
            }
        }
    }

    /// Against a plain search: the offset chosen for several addresses is near none of them
    /// whenever some 64-byte step is, and equals the first address's page offset when that
    /// one fits.
    #[test]
    fn aligned_to_all_avoids_near_offsets() {
        let region = 4096 * 3 + 48;
        let cases: [&[u64]; 5] = [
            &[],
            &[64, 64, 64],
            &[64, 80],
            &[64, 4096 + 64, 100, 3000],
            &[8, 4090, 2048],
        ];
        for addrs in cases {
            let o = aligned_to_all(region, addrs);
            assert!(o < PAGE);
            let ok = |o: usize| addrs.iter().all(|&a| !near(region + o, a as usize));
            let possible = (0..PAGE).any(ok);
            assert_eq!(ok(o), possible, "{addrs:?}: offset {o}");
            if let Some(&a) = addrs.first() {
                if ok(aligned_to(region, a)) {
                    assert_eq!(o, aligned_to(region, a), "{addrs:?}");
                }
            }
        }
        // Offsets 48 bytes apart all round the page: nothing fits; the first address wins.
        let crowded: Vec<u64> = (0..86).map(|i| i * 48 + 8).collect();
        assert!((0..PAGE).all(|o| crowded.iter().any(|&a| near(region + o, a as usize))));
        assert_eq!(
            aligned_to_all(region, &crowded),
            aligned_to(region, crowded[0])
        );
    }

    #[test]
    fn near_is_symmetric_and_excludes_equal() {
        assert!(!near(64, 64 + PAGE));
        assert!(near(64, 80) && near(80, 64));
        assert!(!near(64, 128) && !near(0, 2048));
    }
}
