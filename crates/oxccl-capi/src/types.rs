//! The data type and reduction enums of the C ABI, as plain `int`s (a C caller may pass any
//! value; unknown ones are `oxcclInvalidArgument`).

use oxccl::{DataType, ReduceOp};

use crate::result::CError;

/// `oxcclDataType_t`: NCCL's numbering (`ncclInt8` = 0 ... `ncclBfloat16` = 9), then
/// `oxcclBool` = 10 and `oxcclUint16` = 11.
pub type oxcclDataType_t = i32;

/// `oxcclRedOp_t`: NCCL's numbering (`ncclSum` = 0, `ncclProd`, `ncclMax`, `ncclMin`,
/// `ncclAvg` = 4), then `oxcclBand` = 5, `oxcclBor` = 6, `oxcclBxor` = 7.
pub type oxcclRedOp_t = i32;

/// The library's data type of a C value.
pub fn dtype(v: oxcclDataType_t) -> Result<DataType, CError> {
    Ok(match v {
        0 => DataType::I8,
        1 => DataType::U8,
        2 => DataType::I32,
        3 => DataType::U32,
        4 => DataType::I64,
        5 => DataType::U64,
        6 => DataType::F16,
        7 => DataType::F32,
        8 => DataType::F64,
        9 => DataType::Bf16,
        10 => DataType::Bool,
        11 => DataType::U16,
        _ => return Err(CError::invalid(format!("oxccl: unknown data type {v}"))),
    })
}

/// The library's reduction of a C value: NCCL's numbering is the library's own op code (its
/// wire code, [`ReduceOp::from_code`]) for 0-7; premul_sum (code 8) is not offered here.
pub fn op(v: oxcclRedOp_t) -> Result<ReduceOp, CError> {
    u8::try_from(v)
        .ok()
        .filter(|&c| c <= 7)
        .and_then(ReduceOp::from_code)
        .ok_or_else(|| CError::invalid(format!("oxccl: unknown reduction op {v}")))
}
