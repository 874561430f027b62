//! Element types that collectives move and reduce.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

/// The element types oxccl supports, with NCCL's names.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    /// `i8` (`int8`).
    I8,
    /// `u8` (`uint8`).
    U8,
    /// `i32` (`int32`).
    I32,
    /// `u32` (`uint32`).
    U32,
    /// `i64` (`int64`).
    I64,
    /// `u64` (`uint64`).
    U64,
    /// IEEE half precision (`half`), reduced through f32.
    F16,
    /// bfloat16 (`bfloat16`), reduced through f32.
    Bf16,
    /// `f32` (`float`).
    F32,
    /// `f64` (`double`).
    F64,
    /// `bool` (`bool`): one byte, 0 or 1. Reductions are logical, as in gloo and NCCL: sum and
    /// max are *or*, prod and min are *and*; avg is not defined.
    Bool,
    /// `u16` (`uint16`).
    U16,
}

impl DataType {
    /// Every data type: NCCL's, in NCCL's order, then `bool` and `u16`.
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::Bf16,
        DataType::Bool,
        DataType::U16,
    ];

    /// Size of one element in bytes: a power of two (callers mask and shift by it).
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 | DataType::Bool => 1,
            DataType::F16 | DataType::Bf16 | DataType::U16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// The name nccl-tests prints (`float`, `half`, `bfloat16`, `int32`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F16 => "half",
            DataType::Bf16 => "bfloat16",
            DataType::F32 => "float",
            DataType::F64 => "double",
            DataType::Bool => "bool",
            DataType::U16 => "uint16",
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64
        )
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = String;
    /// Accepts nccl-tests' names and Rust's (`float`/`f32`, `half`/`f16`, `bf16`, ...).
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" | "char" => DataType::I8,
            "uint8" | "u8" => DataType::U8,
            "int32" | "i32" | "int" => DataType::I32,
            "uint32" | "u32" => DataType::U32,
            "int64" | "i64" => DataType::I64,
            "uint64" | "u64" => DataType::U64,
            "half" | "f16" | "float16" => DataType::F16,
            "bfloat16" | "bf16" => DataType::Bf16,
            "float" | "f32" | "float32" => DataType::F32,
            "double" | "f64" | "float64" => DataType::F64,
            "bool" => DataType::Bool,
            "uint16" | "u16" => DataType::U16,
            _ => {
                return Err(format!(
                    "unknown data type '{}' (expected one of int8 uint8 uint16 int32 uint32 int64 uint64 half bfloat16 float double bool)",
                    crate::base::param::table::shown(s)
                ))
            }
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that collectives accept in slices: `i8 u8 u16 i32 u32 i64 u64 f16 bf16 f32 f64`
/// and [`Bool`].
///
/// Sealed: the reduction kernels exist for exactly these types.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + sealed::Sealed {
    /// The matching [`DataType`].
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
        }
    )*};
}
element!(i8 => I8, u8 => U8, u16 => U16, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
         f16 => F16, bf16 => Bf16, f32 => F32, f64 => F64, Bool => Bool);

/// A boolean element ([`DataType::Bool`]): one byte holding 0 or 1, as C's and torch's `bool`
/// (Rust's `bool` cannot be viewed from arbitrary bytes, so slices of it are not accepted).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct Bool(pub u8);

// SAFETY: a transparent wrapper of `u8`: no padding, every bit pattern valid, zero is valid.
unsafe impl bytemuck::Zeroable for Bool {}
// SAFETY: as above; `Bool` is `Copy` and `'static`.
unsafe impl bytemuck::Pod for Bool {}

impl From<bool> for Bool {
    fn from(b: bool) -> Self {
        Bool(b as u8)
    }
}

impl From<Bool> for bool {
    fn from(b: Bool) -> Self {
        b.0 != 0
    }
}

// Every element size is a power of two (validation masks and shifts by it).
const _: () = {
    let mut i = 0;
    while i < DataType::ALL.len() {
        assert!(DataType::ALL[i].size().is_power_of_two());
        i += 1;
    }
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>().unwrap(), d);
        }
        assert!("complex".parse::<DataType>().is_err());
        assert_eq!(<f16 as Element>::DTYPE.size(), 2);
        assert_eq!(<u64 as Element>::DTYPE.size(), 8);
        assert_eq!(<Bool as Element>::DTYPE.size(), 1);
        assert_eq!(<u16 as Element>::DTYPE, DataType::U16);
    }
}
