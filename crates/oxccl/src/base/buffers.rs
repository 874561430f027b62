//! The buffers of one call as raw memory, shared by the executors and the direct collectives.

use std::marker::PhantomData;

/// The buffers of one call, as raw memory (input and output may alias for in-place calls).
pub(crate) struct Buffers<'a> {
    input: *const u8,
    input_len: usize,
    output: *mut u8,
    output_len: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> Buffers<'a> {
    /// Separate input and output (either may be empty).
    pub(crate) fn new(input: &'a [u8], output: &'a mut [u8]) -> Self {
        Buffers {
            input: input.as_ptr(),
            input_len: input.len(),
            output: output.as_mut_ptr(),
            output_len: output.len(),
            _borrow: PhantomData,
        }
    }

    /// One buffer used in place: the input is `buf[input]`, the output `buf[output]`.
    /// Panics if a range is out of bounds (callers compute them from validated lengths).
    pub(crate) fn in_place(
        buf: &'a mut [u8],
        input: std::ops::Range<usize>,
        output: std::ops::Range<usize>,
    ) -> Self {
        assert!(input.start <= input.end && input.end <= buf.len());
        assert!(output.start <= output.end && output.end <= buf.len());
        let base = buf.as_mut_ptr();
        Buffers {
            // SAFETY: both ranges were just checked to lie inside `buf`.
            input: unsafe { base.add(input.start) },
            input_len: input.len(),
            // SAFETY: as above.
            output: unsafe { base.add(output.start) },
            output_len: output.len(),
            _borrow: PhantomData,
        }
    }
}

impl Buffers<'_> {
    /// The input: address and length (for algorithms that publish addresses).
    pub(crate) fn input_raw(&self) -> (*const u8, usize) {
        (self.input, self.input_len)
    }

    /// The output: address and length.
    pub(crate) fn output_raw(&self) -> (*mut u8, usize) {
        (self.output, self.output_len)
    }
}
