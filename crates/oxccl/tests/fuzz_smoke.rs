//! The fuzz targets of `fuzz/` (the decoders of everything that arrives from the network),
//! run for a bounded number of random and mutated inputs on the stable toolchain, so that
//! every test run exercises them. The long, coverage-guided runs are `fuzz/run.sh`.

use oxccl::testing::control::Frame;
use oxccl::testing::fingerprint::{Fingerprint, Header};
use oxccl::testing::fuzzing::TARGETS;
use oxccl::{CollKind, DataType, FailureKind, ReduceOp};
use proptest::prelude::*;

/// Valid messages of each target, to mutate.
fn seeds() -> Vec<Vec<u8>> {
    let h = Header {
        fp: Fingerprint::of(CollKind::Reduce, DataType::F32, ReduceOp::Max, 1 << 40, 3),
        mseq: 9,
    }
    .encode()
    .to_vec();
    let mut frames = Frame::Heartbeat.encode();
    frames.extend(
        Frame::Fail {
            origin: 2,
            kind: FailureKind::Mismatch,
            peer: None,
            msg: "x".repeat(100),
        }
        .encode(),
    );
    frames.extend(Frame::Bye.encode());
    let mut join = vec![16, 0, 0, 0, 1, 4, 0, 0, 0];
    join.extend_from_slice(&[0; 7]);
    vec![h, frames, join, b"OXCCLAUT\x01\x00".to_vec()]
}

/// Cases per property: 3000, ten times that in the stress tier (`OXCCL_STRESS=1`).
fn cases() -> u32 {
    if std::env::var("OXCCL_STRESS").is_ok_and(|v| v == "1") {
        30_000
    } else {
        3000
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(data in proptest::collection::vec(any::<u8>(), 0..300)) {
        for (_, t) in TARGETS {
            t(&data);
        }
    }

    #[test]
    fn mutated_messages(which in 0usize..4, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6), cut in any::<usize>()) {
        let mut m = seeds()[which].clone();
        for (at, v) in flips {
            let n = m.len();
            m[at % n] = v;
        }
        let m = &m[..=cut % m.len()];
        for (_, t) in TARGETS {
            t(m);
            let mut with_side = vec![0u8];
            with_side.extend_from_slice(m);
            t(&with_side);
        }
    }
}
